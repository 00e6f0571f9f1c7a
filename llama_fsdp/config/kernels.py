"""The attention kernels (``model.attn_implementation``): one table that config, validation,
the spec and model/attention.py read (its docstring says how ``varlen`` works).

| name              | what runs                                                            |
|-------------------|----------------------------------------------------------------------|
| auto              | varlen for packed rows on CPU, and on CUDA in 16-bit; sdpa otherwise |
|                   | (``resolve``: once per run, by the spec)                              |
| varlen            | this project's: the records' bounds from the host, no dense mask      |
| sdpa              | transformers' SDPA (a dense block-causal mask for packed rows)        |
| eager, flex_attention, flash_attention_2/3/4 | transformers' own, passed to it unchanged  |

A hub kernel (``kernels-community/flash-attn``: a name with a "/") goes to transformers too.
Torch-free: the command line validates with it.
"""
from __future__ import annotations

AUTO = "auto"
VARLEN = "varlen"
SDPA = "sdpa"  # also what varlen falls back to where it cannot run
EAGER = "eager"
FLEX = "flex_attention"
# ours first (resolved by llama_fsdp), then transformers' names
KERNELS = (AUTO, VARLEN, SDPA, EAGER, FLEX, "flash_attention_2", "flash_attention_3",
           "flash_attention_4")
# the compute dtypes CUDA's flash varlen kernel takes
SIXTEEN_BIT = ("bfloat16", "float16")


def resolve(name: str, *, device: str, compute_dtype: str, packing: bool) -> str:
    """model.attn_implementation as a run uses it: ``auto`` is varlen for packed rows on the CPU,
    and on CUDA in 16-bit (flash varlen_attn, in every torch llama_fsdp runs on); SDPA
    otherwise (unpacked rows take its causal path). Any other name is kept."""
    if name != AUTO:
        return name
    if not packing:
        return SDPA
    return VARLEN if device == "cpu" or compute_dtype in SIXTEEN_BIT else SDPA
