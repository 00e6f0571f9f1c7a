"""Optimizer state per rank and the optimizer step's temporary memory: AdamW's two moments in
the parameters' dtype, or torchao's low-bit moments (optim=adamw8bit | adamw4bit).

torchao (0.18, torchao/optim/adam.py) keeps a parameter's moments in low bits when its local
shard has at least ``MIN_NUMEL`` elements and a whole number of blocks; llama_fsdp.train.optimizer makes
that decision once for every rank's shard (``lowbit_everywhere``), so a parameter is low-bit on
all ranks or on none. A low-bit moment of n elements holds n codes (1 byte in 8 bits, half a
byte in 4), an fp32 scale per block and a lookup table of its code values; a parameter kept in
full precision holds its moments in the parameters' dtype, as AdamW does. Measured against
these formulas byte for byte: tests/multirank/test_optim.py.
"""
from __future__ import annotations

import math
from typing import Iterable

from ..config.schema import OptimConfig
from ..config.optimizers import OPTIMIZERS
from ..config.precision import DTYPE_BYTES
from ..run.spec import RunSpec
from .shapes import param_shapes, sharded_numel

# torchao/optim/adam.py: "follow bitsandbytes, only quantize tensors >= 4096 values"
MIN_NUMEL = 4096
SCALE_BYTES = 4  # one fp32 absmax scale per block
# The step's temporary memory, in fp32 copies of the largest local parameter, by the moments'
# bits: torchao steps one parameter at a time (fp32 math), torch's foreach AdamW all of them at
# once (one param-sized temporary). Measured on CPU gloo ranks (benchmarks/plan_vs_measured_cpu.md,
# optimizer phase less the state), compiled: 8-bit 1.1-1.9, 4-bit 6.0-6.1, AdamW with bf16
# stochastic rounding (one fused in-place kernel) none; eager (optim.eager=true) 13.0-13.8.
STEP_FP32_COPIES = {8: 2.0, 4: 6.5, 0: 0.0}
EAGER_FP32_COPIES = 14.0


def shard_numels(shape: tuple[int, ...], shard: int) -> list[int]:
    """The distinct local element counts of the ranks of a shard group for one parameter,
    rank 0's first (torch.chunk gives at most three: full, one partial, empty)."""
    row, per = math.prod(shape[1:]), math.ceil(shape[0] / shard)
    full, rest = divmod(shape[0], per)
    sizes = [per * row] + ([rest * row] if rest else [])
    return sizes + ([0] if full + bool(rest) < shard else [])


def lowbit_everywhere(numels: Iterable[int], block: int) -> bool:
    """torchao's rule (enough elements, whole blocks) holds for every rank's shard."""
    return all(n >= MIN_NUMEL and n % block == 0 for n in numels)


def moment_bytes(numel: int, optim: OptimConfig, *, lowbit: bool, param_bytes: int) -> int:
    """Bytes of one moment tensor (exp_avg or exp_avg_sq) of a local shard of ``numel``."""
    if not lowbit:
        return numel * param_bytes
    bits = OPTIMIZERS[optim.name].moment_bits
    # codes of ``bits`` each, an fp32 scale per block, and an fp32 code table per tensor
    return int(numel * bits / 8) + numel // optim.block * SCALE_BYTES + 2**bits * 4


def shards(spec: RunSpec) -> list[tuple[int, bool]]:
    """Per parameter: (rank 0's local numel, whether its moments are low-bit). Rank 0 holds
    the largest shard of every parameter."""
    shard, o = spec.mesh.shard, spec.optim
    out = []
    for shape in param_shapes(spec.model):
        numels = shard_numels(shape, shard)
        out.append((numels[0], o.lowbit and lowbit_everywhere(numels, o.block)))
    return out


def optimizer_state_bytes(spec: RunSpec) -> int:
    """Both moments of every parameter, on rank 0 (the step counters, 4 bytes per parameter,
    are left out, for every optimizer)."""
    b = DTYPE_BYTES[spec.policy.param_dtype]
    if not spec.optim.lowbit:
        return 2 * sharded_numel(param_shapes(spec.model), spec.mesh.shard) * b
    return sum(2 * moment_bytes(n, spec.optim, lowbit=low, param_bytes=b)
               for n, low in shards(spec))


def uses_torchao_step(o: OptimConfig, param_dtype: str) -> bool:
    """Whether the step is torchao's per-parameter one (low-bit moments, or AdamW with bf16
    stochastic rounding of bf16 parameters), not torch's foreach AdamW."""
    return o.lowbit or (o.bf16_stochastic_round and param_dtype == "bfloat16")


def optimizer_step_bytes(spec: RunSpec) -> int:
    """Temporary memory of optimizer.step() beyond the state: foreach AdamW's one param-sized
    temporary (all local parameters in their dtype; none for the fused AdamW, CUDA's default),
    or torchao's fp32 copies of the largest local parameter (its step runs parameter by
    parameter)."""
    o, shapes = spec.optim, param_shapes(spec.model)
    if o.fused_on(spec.device):  # one in-place kernel per group of parameters: no temporary
        return 0
    if not uses_torchao_step(o, spec.policy.param_dtype):
        return sharded_numel(shapes, spec.mesh.shard) * DTYPE_BYTES[spec.policy.param_dtype]
    largest = max(sharded_numel([s], spec.mesh.shard) for s in shapes)
    copies = EAGER_FP32_COPIES if o.eager else STEP_FP32_COPIES[OPTIMIZERS[o.name].moment_bits]
    return int(copies * largest * 4)


def describe(spec: RunSpec) -> str:
    """The optimizer-state row of the plan's table."""
    o, dtype = spec.optim, spec.policy.param_dtype
    if not o.lowbit:
        return f"AdamW 2 moments, {dtype}"
    return f"AdamW {OPTIMIZERS[o.name].moment_bits}-bit moments, block {o.block}"
