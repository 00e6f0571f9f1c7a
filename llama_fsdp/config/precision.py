"""The precision policies: what precision=fp32 | mixed | bf16 keeps each tensor in, by dtype
name (strings keep this module free of torch: the spec, the planner and the model code read it).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrecisionPolicy:
    """Dtype names (strings keep this module free of torch)."""

    param_dtype: str  # dtype of the sharded parameters (and so the optimizer state)
    compute_dtype: str  # dtype of the unsharded parameters used in forward/backward
    reduce_dtype: str  # dtype of gradient reduce-scatter / all-reduce

    @property
    def frozen_dtype(self) -> str:
        """dtype of weights that never train (a LoRA base): the compute dtype, since no
        optimizer reads them and a master copy would be memory for nothing."""
        return self.compute_dtype


# Bytes per element of the dtypes a policy names (torch dtypes of the same names: getattr(torch, n)).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

PRECISION_POLICIES = {
    "fp32": PrecisionPolicy("float32", "float32", "float32"),
    "mixed": PrecisionPolicy("float32", "bfloat16", "float32"),
    "bf16": PrecisionPolicy("bfloat16", "bfloat16", "bfloat16"),
}


def resolve_precision(name: str, device: str) -> str:
    """precision=auto: mixed on CUDA (bf16 compute, fp32 master weights), fp32 on CPU."""
    if name != "auto":
        return name
    return "mixed" if device == "cuda" else "fp32"
