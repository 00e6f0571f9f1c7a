"""The vocabulary every memory model speaks: the components of a step's memory (``Memory``) and
the phases of a step (``PHASES``). A leaf: the models (full.py, lora.py, ddp.py) and fit.py
import it, it imports none of them."""
from __future__ import annotations

from dataclasses import dataclass

from ..run.spec import RunSpec

# The phases of a training step whose peaks the models give (full.full_phase_peaks says what is
# live in each), from the second step on (with optimizer state).
FORWARD, LOSS, LAYERS, ROOT, OPTIMIZER = "forward", "loss", "layers", "root", "optimizer"
PHASES = (FORWARD, LOSS, LAYERS, ROOT, OPTIMIZER)
# DPO with a live reference: its forward, before the policy's (plan/preference.py)
REFERENCE = "reference"


@dataclass(frozen=True)
class Memory:
    """Per-device sizes of the components of a training step's memory.

    They are never all live at once (grads are None until the first reduce-scatter, the
    all-gather / reduce-scatter buffers and the recomputed layer come and go during backward),
    so ``total``, their sum, mostly over-states the peak (by 10-37% on CPU, see
    benchmarks/plan_vs_measured_cpu.md), and it misses foreach AdamW's param-sized temporary.
    The prediction is the largest phase peak (``Plan.predicted_peak_bytes``).
    """

    params: int  # sharded parameters (param dtype)
    grads: int  # sharded gradients (param dtype)
    optimizer: int  # AdamW exp_avg + exp_avg_sq (param dtype, or low-bit: plan/optimizer.py)
    unsharded_params: int  # reshard_after_forward=False: all params in compute dtype
    comm_buffers: int  # all-gather / reduce-scatter in flight; the largest unit's too
    activations: int
    logits_loss: int
    host: int = 0  # cpu_offload: sharded params, grads, optimizer state in host RAM
    host_activations: int = 0  # checkpointing.offload: the checkpointed inputs in host RAM
    runtime: int = 0  # CUDA library workspaces, live in every phase (device.runtime_bytes)

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        """The sum of the components: an upper bound, not the predicted peak."""
        return (self.model_state + self.unsharded_params + self.comm_buffers + self.activations
                + self.logits_loss + self.runtime)


def alone(spec: RunSpec) -> bool:
    """Whether FSDP2 shards over a group of one rank (one device, or HSDP with shard size 1):
    it then runs no collective, neither all-gather nor reduce-scatter. Its unshard copies each
    shard into the unsharded parameter directly and keeps no all-gather output for the next
    unit's copy-out, and its reduce-scatter is a copy (torch's FSDPParamGroup.unshard /
    wait_for_unshard and foreach_reduce at world_size 1), so no gloo copy either. Measured: the
    8B LoRA and QLoRA runs on one H200 (benchmarks/gpu.md) and the 1-rank chunked-loss rows of
    benchmarks/plan_vs_measured_cpu.md, where the held head all-gather was over-planned by the
    head's size."""
    return spec.mesh.shard == 1 and not spec.mesh.ddp


def reduce_scatter_copies(spec: RunSpec, *, gloo: bool) -> int:
    """Copies of a reduce-scatter's input live at once: the input, and gloo's own copy of it
    where a collective runs (NCCL reduces in place; a group of one runs none: ``alone``)."""
    return 2 if gloo and not alone(spec) else 1
