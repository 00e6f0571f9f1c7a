"""The Linear projections of one Llama decoder layer and their weight shapes (pure arithmetic,
a leaf: the planner, NF4's shape checks and the adapters read it)."""
from __future__ import annotations

from .schema import ModelConfig


def projection_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """One decoder layer's Linear weights (out, in) by module name, in the layer's order."""
    h, q = m.hidden_size, m.hidden_size // m.num_heads
    kv, i = m.num_kv_heads * q, m.intermediate_size
    return {"q_proj": (m.num_heads * q, h), "k_proj": (kv, h), "v_proj": (kv, h),
            "o_proj": (h, m.num_heads * q), "gate_proj": (i, h), "up_proj": (i, h),
            "down_proj": (h, i)}
