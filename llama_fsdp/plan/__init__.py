"""Know before you launch: parameters, FLOPs per token and per-device memory of a RunSpec.

Pure arithmetic on the spec (no process group, no GPU; torch is imported only to read a local
CUDA device's size). Where to find what:

- ``shapes.py``: parameter shapes, counts, FLOPs per token, what a shard holds;
- ``activations.py``: what autograd saves for backward (per layer, packed attention, logits);
- ``memory.py``: the components of a step's memory and the peak of each phase (FSDP2);
- ``ddp.py``: the same for sharding=no_shard;
- ``device.py``: the device's memory and peak FLOP/s;
- ``fit.py``: ``make_plan`` -> ``Plan``, ``check_fits``, the cheapest fixes, ``sharding=auto``.

Units: ``*_gb`` values are decimal GB (1e9 bytes), as the worker's ``peak_memory_gb`` metric
(``torch.cuda.max_memory_allocated() / 1e9``); the table shows GiB beside them.
"""
from .activations import (
    activation_bytes,
    layer_activation_bytes,
    logits_loss_bytes,
    packed_mask_bytes,
    saved_layer_bytes,
    varlen_mask_bytes,
)
from .device import GB, device_capacity_bytes, peak_flops
from .fit import (
    DEFAULT_MARGIN,
    DEFAULT_MFU,
    GIB,
    Plan,
    PlanError,
    check_fits,
    choose_strategy,
    fixes_text,
    make_plan,
    nodes_needed,
    reference_spec,
    resolve_auto,
    with_nodes,
    with_strategy,
)
from .memory import PHASES, Memory, memory_breakdown, model_state_bytes, phase_peak_bytes, phase_peaks
from .shapes import count_params, flops_per_token, layer_shapes, n_matmul, numel, param_shapes, root_shapes, sharded_numel

__all__ = ["DEFAULT_MARGIN", "DEFAULT_MFU", "GB", "GIB", "Memory", "PHASES", "Plan", "PlanError",
           "activation_bytes", "check_fits", "choose_strategy", "count_params",
           "device_capacity_bytes", "fixes_text", "flops_per_token", "layer_activation_bytes",
           "layer_shapes", "logits_loss_bytes", "make_plan", "memory_breakdown",
           "model_state_bytes", "n_matmul", "nodes_needed", "numel", "packed_mask_bytes",
           "param_shapes", "peak_flops", "phase_peak_bytes", "phase_peaks", "reference_spec",
           "resolve_auto", "root_shapes", "saved_layer_bytes", "sharded_numel",
           "varlen_mask_bytes", "with_nodes", "with_strategy"]
