"""Llama from transformers, built on the meta device. No parallelism here (see parallelize.py)."""
from __future__ import annotations

import json
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from . import attention
from ..config.schema import ModelConfig
from ..config.hf_dir import HF_FIELDS

log = logging.getLogger(__name__)


def rope_parameters(m: ModelConfig) -> dict:
    """transformers' ``rope_parameters`` for a model group (theta, and llama3 scaling if set)."""
    rope: dict = {"rope_type": "default", "rope_theta": float(m.rope_theta)}
    if m.rope_scaling is not None:
        rs = m.rope_scaling
        rope.update(rope_type=rs.rope_type, factor=float(rs.factor),
                    low_freq_factor=float(rs.low_freq_factor),
                    high_freq_factor=float(rs.high_freq_factor),
                    original_max_position_embeddings=int(rs.original_max_position_embeddings))
    return rope


def llama_config(m: ModelConfig, *, dtype: Optional[torch.dtype] = None) -> LlamaConfig:
    """The transformers config for a model group option (exact Llama 3.x shapes)."""
    fields = {key: getattr(m, f) for f, key in HF_FIELDS.items() if f != "rope_theta"}
    cfg = LlamaConfig(**fields, max_position_embeddings=m.max_position_embeddings,
                      rope_parameters=rope_parameters(m), initializer_range=m.init_std,
                      use_cache=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    # "auto" is resolved per run (spec.build_spec); a config made outside a run gets SDPA
    cfg._attn_implementation = (attention.FALLBACK if m.attn_implementation == attention.AUTO
                                else m.attn_implementation)
    if dtype is not None:
        cfg.dtype = dtype
    return cfg


def build_meta_model(m: ModelConfig) -> LlamaForCausalLM:
    """The model with every parameter on the meta device: no memory, any size."""
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(m))
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks, the unit of sharding and activation checkpointing."""
    return model.model.layers  # type: ignore[return-value]


def num_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())


def retie_embeddings(model: LlamaForCausalLM) -> None:
    """Tie the head to the embedding again where the config ties them: moving a plain model off
    the meta device (``to_empty``) makes each module its own tensor, so the tie would silently
    become two parameters (FSDP2 keeps shared parameters shared itself)."""
    if model.config.tie_word_embeddings:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight


INIT_BLOCK_NUMEL = 1 << 20  # elements per independently seeded block of rows


@torch.no_grad()
def init_weights(model: LlamaForCausalLM, *, std: float, seed: int) -> None:
    """Deterministic init of a model already moved off meta (sharded or not), local shards only.

    Same values on every rank and for every world size, without drawing any full tensor: each
    parameter's rows are cut into fixed blocks (about INIT_BLOCK_NUMEL elements, the same cut for
    any world size), each block drawn from its own generator seeded by (seed, parameter, block),
    and a rank draws only the blocks its shard overlaps. A 70B model's ranks draw 1/world of it,
    with no collective; a 1-rank and a 4-rank run still start from the same weights, which is
    what the correctness tests compare.
    """
    n_layers = model.config.num_hidden_layers
    for index, (name, p) in enumerate(model.named_parameters()):
        local, offset = _local_view(p)
        rows = local.shape[0] if local.dim() else 1
        local.copy_(init_rows(name, tuple(p.shape), offset, rows, index=index, std=std,
                              seed=seed, n_layers=n_layers).view(local.shape))
    init_buffers(model)


def init_rows(name: str, shape: tuple[int, ...], start: int, rows: int, *, index: int,
              std: float, seed: int, n_layers: int) -> torch.Tensor:
    """Rows [start, start + rows) of the initial value of parameter ``name`` (the
    ``index``-th of the model's parameters), fp32 on the CPU: ones for the RMSNorm weights,
    normal(0, std) elsewhere, std / sqrt(2 L) for the projections into the residual stream
    (GPT-2-style). init_weights fills shards with it; adapters.init_base, an NF4 base."""
    if name.endswith("norm.weight"):
        return torch.ones((rows, *shape[1:]))
    s = std
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        s = std / math.sqrt(2 * n_layers)
    return _normal_rows(shape, start, rows, seed=seed, index=index) * s  # a tensor of its own


def _local_view(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's part of ``p`` and the global row (dim-0 index) it starts at. FSDP2 shards
    dim 0 only (replicated on other mesh dims), so the part is a block of whole rows."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return p, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    local = p.to_local()
    if local.dim() and any(o for o in offset[1:]):
        raise RuntimeError(f"init expects dim-0 shards, got offset {offset} for {tuple(p.shape)}")
    return local, (offset[0] if offset else 0)


def _normal_rows(shape: tuple[int, ...], start: int, rows: int, *, seed: int,
                 index: int) -> torch.Tensor:
    """Rows [start, start + rows) of a standard-normal tensor of ``shape`` defined block by
    block (see init_weights); drawn on the CPU, so the values do not depend on the device.
    The blocks are drawn on torch's intra-op threads at once (each has its own generator, so
    the values are the same for any thread count): drawn one after another, an 8B model's init
    takes most of a minute (benchmarks/gpu.md)."""
    row_numel = math.prod(shape[1:])
    per_block = max(1, INIT_BLOCK_NUMEL // max(row_numel, 1))
    total_rows = shape[0] if shape else 1
    blocks = range(start // per_block, -(-(start + rows) // per_block) if rows else 0)
    if not blocks:
        return torch.empty((0, *shape[1:]))
    first = blocks[0] * per_block
    drawn = torch.empty((min(blocks[-1] * per_block + per_block, total_rows) - first,
                         *shape[1:]))

    def draw(block: int) -> None:
        lo, hi = block * per_block, min((block + 1) * per_block, total_rows)
        gen = torch.Generator(device="cpu")
        gen.manual_seed((seed * 1_000_003 + index) * 1_000_033 + block)
        drawn[lo - first:hi - first].normal_(generator=gen)  # torch.randn's values, in place

    threads = min(torch.get_num_threads(), len(blocks))
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(draw, blocks))
    else:
        for block in blocks:
            draw(block)
    return drawn[start - first:start - first + rows]


def init_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (RoPE frequencies): computed, never loaded from a checkpoint."""
    for buf_name, _ in model.named_buffers():
        if "inv_freq" in buf_name:
            _reset_rope_buffer(model, buf_name)


def _reset_rope_buffer(model: nn.Module, buf_name: str) -> None:
    """Recompute RoPE inverse frequencies (buffers built on meta hold no values)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    owner_name, _, attr = buf_name.rpartition(".")
    owner = model.get_submodule(owner_name)
    device = getattr(owner, attr).device
    rope_type = getattr(owner, "rope_type", "default")
    cfg = model.config
    if rope_type == "default":
        base = cfg.rope_parameters["rope_theta"]
        dim = cfg.hidden_size // cfg.num_attention_heads
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, device="cpu")
    setattr(owner, attr, inv_freq.to(device))
    if hasattr(owner, "original_inv_freq"):
        owner.original_inv_freq = inv_freq.to(device)
    if hasattr(owner, "attention_scaling"):
        owner.attention_scaling = scaling


def read_hf_config(path: str) -> dict:
    """config.json of a local HF directory (hub names resolve through huggingface_hub)."""
    p = Path(path)
    if p.is_dir():
        return json.loads((p / "config.json").read_text())
    from huggingface_hub import hf_hub_download

    return json.loads(Path(hf_hub_download(path, "config.json")).read_text())
