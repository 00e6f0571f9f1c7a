"""The attention kernels (``model.attn_implementation``): one table that config, validation,
the spec and attention.py read (attention.py's docstring says how ``varlen`` works).

| name              | what runs                                                            |
|-------------------|----------------------------------------------------------------------|
| auto              | varlen for packed rows on CPU, and on CUDA in 16-bit where torch has  |
|                   | varlen_attn; sdpa otherwise (resolved per run: spec.resolve_attention) |
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
# ours first (resolved by llama_fsdp), then transformers' names
KERNELS = (AUTO, VARLEN, SDPA, "eager", "flex_attention", "flash_attention_2",
           "flash_attention_3", "flash_attention_4")
