"""Know before you launch: parameters, FLOPs per token and per-device memory of a RunSpec.

Pure arithmetic on the spec (no process group, no GPU; torch is imported only to read a local
CUDA device's size). Imports run one way, from the leaves up. Where to find what:

- ``phases.py``: ``Memory`` (a step's components) and ``PHASES`` (a step's phases): a leaf;
- ``shapes.py``: parameter shapes, counts, FLOPs per token, what a shard holds;
- ``activations.py``: what autograd saves for backward (per layer, packed attention, offload);
- ``loss.py``: the loss path's terms (train.loss=chunked | full);
- ``full.py``: full fine-tuning's memory per phase (FSDP2); ``ddp.py``: sharding=no_shard's;
  ``lora.py``: finetune=lora | qlora's (a frozen base); ``optimizer.py``: optimizer state;
- ``device.py``, ``host.py``: what a device and the host offer, and what lives on the host;
- ``variants.py``: what-if specs, each accepted by the validator;
- ``fit.py``: ``make_plan`` -> ``Plan`` (full or lora chosen here), ``longest_seq_len``;
- ``table.py``: the plan as printed; ``search.py``: nodes and ``sharding=auto``;
- ``fixes.py``: ``check_fits`` and the cheapest fixes.

Units: ``*_gb`` values are decimal GB (1e9 bytes), as the worker's ``peak_memory_gb`` metric
(``torch.cuda.max_memory_allocated() / 1e9``); the table shows GiB beside them.
"""
from .activations import (
    activation_bytes,
    flash_varlen_runs,
    layer_activation_bytes,
    packed_mask_bytes,
    saved_layer_bytes,
    varlen_backward_bytes,
    varlen_backward_extra,
    varlen_mask_bytes,
)
from .device import GB, device_capacity_bytes, peak_flops
from .fit import (
    DEFAULT_MARGIN,
    DEFAULT_MFU,
    GIB,
    Plan,
    flops_per_token_of,
    longest_seq_len,
    make_plan,
    memory_breakdown,
    model_state_bytes,
    phase_peak_bytes,
    phase_peaks,
)
from .remedies import PlanError, check_fits, fixes_text
from .loss import logits_loss_bytes, loss_bytes
from .phases import PHASES, Memory
from .search import auto_hint, choose_strategy, nodes_needed, resolve_auto
from .shapes import (
    count_params,
    flops_per_token,
    layer_shapes,
    n_matmul,
    numel,
    param_shapes,
    root_shapes,
    sharded_numel,
)
from .variants import reference_spec, with_nodes, with_seq_len, with_strategy

__all__ = ["DEFAULT_MARGIN", "DEFAULT_MFU", "GB", "GIB", "Memory", "PHASES", "Plan", "PlanError",
           "activation_bytes", "auto_hint", "check_fits", "choose_strategy", "count_params",
           "device_capacity_bytes", "fixes_text", "flash_varlen_runs", "flops_per_token",
           "flops_per_token_of", "layer_activation_bytes", "layer_shapes", "logits_loss_bytes",
           "longest_seq_len",
           "loss_bytes", "make_plan", "memory_breakdown", "model_state_bytes", "n_matmul",
           "nodes_needed", "numel", "packed_mask_bytes", "param_shapes", "peak_flops",
           "phase_peak_bytes", "phase_peaks", "reference_spec", "resolve_auto", "root_shapes",
           "saved_layer_bytes", "sharded_numel", "varlen_backward_bytes",
           "varlen_backward_extra", "varlen_mask_bytes", "with_nodes", "with_seq_len",
           "with_strategy"]
