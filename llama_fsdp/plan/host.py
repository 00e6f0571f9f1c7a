"""Host RAM per rank: where the plan puts memory on the host (sharding.cpu_offload's state;
checkpointing.offload's layer inputs; the weights on their way in) against the host's RAM (this
machine's, or cluster.mem_gb on SLURM).

Loading never needs a whole tensor, let alone a model, on the host: from HF files each rank
reads one tensor's rows at a time (DCP's HuggingFaceStorageReader; file dtype taken as 16-bit,
as Llama checkpoints are), and a seeded init draws one parameter's rows at a time in fp32.
qlora reads one decoder layer's target rows into 16-bit staging shards and quantizes them on
the run's device: on a CPU run that staging and torchao's quantization temporaries are host
memory too, beside the shards already filled.
"""
from __future__ import annotations

import math
from typing import Optional

from ..config import nf4
from ..config.precision import DTYPE_BYTES
from ..run.spec import RunSpec
from .activations import checkpointed_inputs
from .shapes import param_shapes, projection_shapes

FILE_BYTES = 2  # HF Llama checkpoints are bf16


def _local_rows(rows: int, shard: int) -> int:
    return math.ceil(rows / shard)


def read_bytes(spec: RunSpec) -> int:
    """The largest piece of one tensor a rank holds on the host while its shards are filled:
    its rows of the largest parameter, in 16 bits from HF files or fp32 from the seeded init."""
    shard = spec.mesh.shard
    each = FILE_BYTES if spec.model.path else 4
    return max(_local_rows(s[0], shard) * math.prod(s[1:]) for s in param_shapes(spec.model)) * each


def staging_bytes(spec: RunSpec) -> int:
    """qlora from HF files: one decoder layer's target rows per rank in the frozen dtype, read
    before they are quantized (checkpoint.peft.load_hf_base: its ``staging_bytes``)."""
    ft = spec.finetune
    if not (ft.nf4 and spec.model.path):
        return 0
    shard = spec.mesh.shard
    f = DTYPE_BYTES[spec.policy.frozen_dtype]
    return sum(_local_rows(rows, shard) * cols * f
               for name, (rows, cols) in projection_shapes(spec.model).items()
               if name in ft.target_modules)


def quantize_temp_bytes(spec: RunSpec) -> int:
    """qlora: torchao's temporaries while quantizing the largest target shard."""
    ft = spec.finetune
    if not ft.nf4:
        return 0
    shapes = projection_shapes(spec.model)
    numel = max(_local_rows(shapes[t][0], spec.mesh.shard) * shapes[t][1]
                for t in ft.target_modules)
    return nf4.quantize_bytes(numel, dtype_bytes=DTYPE_BYTES[spec.policy.frozen_dtype],
                              block_size=ft.nf4_block_size)


def load_peak_bytes(spec: RunSpec, params: int) -> int:
    """Peak host RAM per rank while the weights go in (``params``: this rank's parameter
    bytes). On CUDA only the piece being read is on the host; on a CPU run the shards, the
    staging and the quantization are host memory too."""
    if spec.device == "cuda":
        return read_bytes(spec)
    return params + read_bytes(spec) + staging_bytes(spec) + quantize_temp_bytes(spec)


def pinned_bytes(n: int) -> int:
    """A pinned host block as CUDA's caching host allocator hands it out: rounded up to a power
    of two (c10's CachingHostAllocator), so it can be reused for any smaller request."""
    return 1 << max(n - 1, 0).bit_length()


def activation_host_bytes(spec: RunSpec) -> int:
    """checkpointing.offload on CUDA: the checkpointed layers' inputs (b x s x hidden each, in
    the residual stream's dtype: the param dtype under DDP's autocast) held in pinned host
    memory from their forward to their backward. On CPU they stay where they are: host memory,
    counted as the run's device memory."""
    m, t, p = spec.model, spec.train, spec.policy
    _, on_host = checkpointed_inputs(spec.checkpointing, m.num_layers, spec.device)
    wide = spec.mesh.ddp and p.param_dtype != p.compute_dtype
    each = DTYPE_BYTES[p.param_dtype if wide else p.compute_dtype]
    return on_host * pinned_bytes(t.batch_size * t.seq_len * m.hidden_size * each)


def host_capacity_bytes(spec: RunSpec) -> tuple[Optional[int], str]:
    """(host RAM one rank may use, where that came from); None where it is not known (a SLURM
    job without cluster.mem_gb gets what the partition gives)."""
    place = spec.placement
    if place.ram_bytes is None:
        return None, place.ram_source
    return place.ram_bytes // spec.nproc_per_node, f"{place.ram_source} / ranks per node"
