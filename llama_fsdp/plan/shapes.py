"""Shapes, parameter counts and FLOPs of a Llama model group (pure arithmetic)."""
from __future__ import annotations

import math

from ..config.schema import ModelConfig
from ..config.schema import projection_shapes


def layer_shapes(m: ModelConfig) -> list[tuple[int, ...]]:
    """One decoder layer's parameters (no biases, as transformers' Llama)."""
    h = m.hidden_size
    return [*projection_shapes(m).values(),  # q, k, v, o, gate, up, down
            (h,), (h,)]  # input and post-attention RMSNorm


def root_shapes(m: ModelConfig) -> list[tuple[int, ...]]:
    """Parameters outside the decoder layers: embedding, final norm, head (once if tied)."""
    shapes = [(m.vocab_size, m.hidden_size), (m.hidden_size,)]
    if not m.tie_word_embeddings:
        shapes.append((m.vocab_size, m.hidden_size))
    return shapes


def param_shapes(m: ModelConfig) -> list[tuple[int, ...]]:
    """Every unique parameter tensor of LlamaForCausalLM."""
    return root_shapes(m) + layer_shapes(m) * m.num_layers


def numel(shapes: list[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


def count_params(m: ModelConfig) -> int:
    """Exact parameter count (a tied embedding counts once)."""
    return numel(param_shapes(m))


def n_matmul(m: ModelConfig) -> int:
    """Parameters used in matmuls: all but the input embedding (kept when tied to the head)."""
    embed = m.vocab_size * m.hidden_size
    return count_params(m) - (0 if m.tie_word_embeddings else embed)


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6·N_matmul + 12·L·H·Q·T (no causal discount)."""
    q = m.hidden_size // m.num_heads
    return 6.0 * n_matmul(m) + 12.0 * m.num_layers * m.num_heads * q * seq_len


def sharded_numel(shapes: list[tuple[int, ...]], shard: int) -> int:
    """Elements one rank stores: FSDP2 splits dim 0 in ceil(d0/shard) rows and pads the last."""
    return sum(math.ceil(s[0] / shard) * math.prod(s[1:]) for s in shapes)
