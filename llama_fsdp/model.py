"""Llama from transformers, built on the meta device. No parallelism here (see parallel.py)."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from .config import ModelConfig

log = logging.getLogger(__name__)


def llama_config(m: ModelConfig, *, dtype: Optional[torch.dtype] = None) -> LlamaConfig:
    """The transformers config for a model group option (exact Llama 3.x shapes)."""
    rope: dict = {"rope_type": "default", "rope_theta": float(m.rope_theta)}
    if m.rope_scaling is not None:
        rs = m.rope_scaling
        rope = {
            "rope_type": rs.rope_type,
            "rope_theta": float(m.rope_theta),
            "factor": float(rs.factor),
            "low_freq_factor": float(rs.low_freq_factor),
            "high_freq_factor": float(rs.high_freq_factor),
            "original_max_position_embeddings": int(rs.original_max_position_embeddings),
        }
    cfg = LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.rms_norm_eps,
        tie_word_embeddings=m.tie_word_embeddings,
        rope_parameters=rope,
        initializer_range=m.init_std,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    cfg._attn_implementation = m.attn_implementation
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


@torch.no_grad()
def init_weights(model: LlamaForCausalLM, *, std: float, seed: int) -> None:
    """Deterministic init of a model already moved off meta (sharded or not).

    Same values on every rank and for every world size: each full tensor is drawn from one
    generator in a fixed order, then the local shard is taken. So a 1-rank and a 4-rank run
    start from the same weights, which is what the correctness tests compare.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n_layers = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        full_shape = p.shape
        if name.endswith("norm.weight"):
            full = torch.ones(full_shape)
        else:
            s = std
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                s = std / math.sqrt(2 * n_layers)  # GPT-2-style residual scaling
            full = torch.randn(full_shape, generator=gen) * s
        _copy_full_into(p, full)
    init_buffers(model)


def init_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (RoPE frequencies): computed, never loaded from a checkpoint."""
    for buf_name, _ in model.named_buffers():
        if "inv_freq" in buf_name:
            _reset_rope_buffer(model, buf_name)


def _copy_full_into(p: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        local = distribute_tensor(full.to(p.device), p.device_mesh, p.placements).to_local()
        p.to_local().copy_(local)
    else:
        p.copy_(full)


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
