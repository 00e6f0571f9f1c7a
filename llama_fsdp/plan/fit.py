"""The plan of a run (``make_plan`` -> ``Plan``: parameters, FLOPs per token, memory per phase
against the device) and the longest sequence that fits (``longest_seq_len``).

The one place where full fine-tuning's memory model (full.py) or the frozen base's (lora.py) is
chosen for a spec: ``model_state_bytes``, ``memory_breakdown``, ``phase_peaks`` and
``flops_per_token_of`` below. The table is table.py's, the fixes fixes.py's, the searches over
strategies and nodes search.py's.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

from ..run.spec import RunSpec
from . import full, lora, preference
from .harness import harness_bytes
from .device import GB, device_capacity_bytes, peak_flops, runtime_bytes
from .host import activation_host_bytes, host_capacity_bytes, load_peak_bytes
from .phases import Memory
from .shapes import count_params, flops_per_token, n_matmul
from .table import render
from .variants import with_seq_len

GIB = 2**30
DEFAULT_MARGIN = 0.10  # keep 10% of the device free (allocator fragmentation, CUDA context)
DEFAULT_MFU = 0.40


# ---------------------------------------------------------------------------------------------
# Full fine-tuning or a frozen base: chosen here, once


def model_state_bytes(spec: RunSpec) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes one rank holds for its shards, wherever they live."""
    return (lora.lora_state_bytes if spec.finetune.adapters else full.full_state_bytes)(spec)


def memory_breakdown(spec: RunSpec) -> Memory:
    """The components of one training step's memory per device, the CUDA workspaces with them
    (``runtime_bytes``, which phase_peaks adds to every phase)."""
    memory = (lora.lora_memory_breakdown if spec.finetune.adapters
              else full.full_memory_breakdown)(spec)
    return dataclasses.replace(memory, runtime=runtime_bytes(spec))


def phase_peaks(spec: RunSpec, *, gloo: bool) -> dict[str, int]:
    """Bytes per rank at the peak of each phase of a training step (``gloo``: with gloo's copy
    of a reduce-scatter's input, for CPU runs); full.full_phase_peaks says what each holds,
    preference.phase_peaks what objective=dpo's reference adds, and device.runtime_bytes the
    CUDA workspaces every phase holds."""
    policy = (lora.lora_phase_peaks if spec.finetune.adapters
              else full.full_phase_peaks)(spec, gloo=gloo)
    runtime = runtime_bytes(spec)
    peaks = {k: v + runtime for k, v in preference.phase_peaks(spec, policy).items()}
    if spec.eval.harness.tasks:  # on rank 0, after training (and every N steps, beside it)
        peaks["harness"] = runtime + harness_bytes(
            spec, during_training=spec.eval.harness.every_steps > 0)
    return peaks


def phase_peak_bytes(spec: RunSpec, *, gloo: bool) -> int:
    """The largest of phase_peaks: the predicted peak per rank."""
    return max(phase_peaks(spec, gloo=gloo).values())


def flops_per_token_of(spec: RunSpec) -> float:
    """Forward + backward FLOPs per token of this run (a frozen base has no weight gradients),
    with objective=dpo's reference forward."""
    m, t = spec.model, spec.train
    ref = preference.reference_flops_per_token(spec)
    if spec.finetune.adapters:
        return lora.lora_flops_per_token(m, spec.finetune, t.seq_len) + ref
    return flops_per_token(m, t.seq_len) + ref


# ---------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class Plan:
    """What one run needs per device, and what it should achieve."""

    spec: RunSpec
    num_params: int
    n_matmul: int
    flops_per_token: float
    memory: Memory
    capacity_bytes: int
    capacity_source: str
    peak_flops: Optional[float]
    margin: float = DEFAULT_MARGIN
    mfu: float = DEFAULT_MFU
    # phase_peaks(spec, gloo=spec.device == "cpu"); make_plan fills it, computed if left empty
    phases: dict[str, int] = dataclasses.field(default_factory=dict)
    # host RAM per rank while the weights go in (plan/host.py), and what one rank may use
    # (None: not known)
    host_load_bytes: int = 0
    host_capacity_bytes: Optional[int] = None
    host_capacity_source: str = ""

    def __post_init__(self) -> None:
        if not self.phases:
            object.__setattr__(self, "phases",
                               phase_peaks(self.spec, gloo=self.spec.device == "cpu"))

    @property
    def peak_phase(self) -> str:
        """The phase of the step where the predicted peak is."""
        return max(self.phases, key=self.phases.get)

    @property
    def predicted_peak_bytes(self) -> int:
        """The largest phase peak (not memory.total, which adds what is never live at once)."""
        return self.phases[self.peak_phase]

    @property
    def predicted_peak_gb(self) -> float:
        """Decimal GB, comparable with the worker's peak_memory_gb metric."""
        return self.predicted_peak_bytes / GB

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.predicted_peak_bytes

    @property
    def usable_bytes(self) -> int:
        """Capacity less the safety margin."""
        return int(self.capacity_bytes * (1 - self.margin))

    @property
    def host_peak_bytes(self) -> int:
        """Host RAM one rank needs: while loading, or all through with sharding.cpu_offload and
        checkpointing.offload (a CPU run's training state is its device memory, checked as
        such)."""
        return max(self.host_load_bytes, self.memory.host + self.memory.host_activations)

    @property
    def host_fits(self) -> bool:
        return (self.host_capacity_bytes is None
                or self.host_peak_bytes <= int(self.host_capacity_bytes * (1 - self.margin)))

    @property
    def device_fits(self) -> bool:
        return self.predicted_peak_bytes <= self.usable_bytes

    @property
    def fits(self) -> bool:
        return self.device_fits and self.host_fits

    @functools.cached_property
    def longest_seq_len(self) -> int:
        """The longest train.seq_len that fits at this micro-batch (0: none)."""
        return longest_seq_len(self.spec, margin=self.margin)

    @property
    def tokens_per_device_step(self) -> int:
        t = self.spec.train
        return t.batch_size * t.grad_accum * t.seq_len

    def tokens_per_s_per_device(self, mfu: Optional[float] = None) -> Optional[float]:
        """Throughput at the given MFU (default: the plan's), if the peak FLOP/s is known."""
        if self.peak_flops is None:
            return None
        return (mfu or self.mfu) * self.peak_flops / self.flops_per_token

    def step_time_s(self, mfu: Optional[float] = None) -> Optional[float]:
        """Seconds per optimizer step at the given MFU, if the peak FLOP/s is known."""
        tps = self.tokens_per_s_per_device(mfu)
        return None if tps is None else self.tokens_per_device_step / tps

    def metrics(self) -> dict[str, float]:
        """Numbers to log with the run (MLflow params / metrics)."""
        out = {"predicted_peak_memory_gb": round(self.predicted_peak_gb, 3),
               "plan_device_capacity_gb": round(self.capacity_bytes / GB, 3),
               "plan_num_params": float(self.num_params),
               "plan_flops_per_token": self.flops_per_token,
               "plan_host_peak_gb": round(self.host_peak_bytes / GB, 3)}
        if (step := self.step_time_s()) is not None:
            out[f"plan_step_time_s_at_{round(self.mfu * 100)}pct_mfu"] = step
        return out

    def table(self) -> str:
        return render(self)


def make_plan(spec: RunSpec, *, mfu: float = DEFAULT_MFU, margin: float = DEFAULT_MARGIN) -> Plan:
    """Parameters, FLOPs per token and per-device memory of a run, against its device."""
    capacity, source = device_capacity_bytes(spec)
    memory = memory_breakdown(spec)
    memory = dataclasses.replace(memory, host_activations=activation_host_bytes(spec))
    host, host_source = host_capacity_bytes(spec)
    return Plan(spec=spec, num_params=count_params(spec.model), n_matmul=n_matmul(spec.model),
                flops_per_token=flops_per_token_of(spec),
                memory=memory, capacity_bytes=capacity, capacity_source=source,
                peak_flops=peak_flops(spec), margin=margin, mfu=mfu,
                phases=phase_peaks(spec, gloo=spec.device == "cpu"),
                host_load_bytes=load_peak_bytes(spec, memory.params),
                host_capacity_bytes=host, host_capacity_source=host_source)


# the search's unit: sequence lengths are reported in whole multiples of this many tokens
SEQ_STEP = 128


def longest_seq_len(spec: RunSpec, *, margin: float = DEFAULT_MARGIN) -> int:
    """The longest train.seq_len (a multiple of SEQ_STEP, at most
    model.max_position_embeddings) at which this run, micro-batch and all, fits its devices
    and host; 0 if not even SEQ_STEP tokens do. Memory grows with the sequence, so a binary
    search over plans finds it."""
    def fits(units: int) -> bool:
        return make_plan(with_seq_len(spec, units * SEQ_STEP), margin=margin).fits

    lo, hi = 0, spec.model.max_position_embeddings // SEQ_STEP
    if hi and fits(hi):
        return hi * SEQ_STEP
    while lo + 1 < hi:  # fits(lo) (or lo == 0), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * SEQ_STEP
