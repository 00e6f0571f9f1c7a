"""The memory model of sharding=no_shard (composable DDP): a full replica per rank, gradients
in DDP's buckets, one bucket all-reduced at a time."""
from __future__ import annotations

from ..config.precision import DTYPE_BYTES
from ..run.spec import RunSpec
from ..config.strategies import DDP_BUCKET_MB
from .activations import checkpointed_inputs
from .loss import LossBytes
from .shapes import count_params, layer_shapes, numel
from .phases import FORWARD, LAYERS, LOSS, OPTIMIZER, ROOT


def ddp_bucket_bytes(spec: RunSpec) -> int:
    """One DDP bucket: the gradients, in param dtype, up to the bucket cap."""
    return min(DDP_BUCKET_MB * 2**20,
               count_params(spec.model) * DTYPE_BYTES[spec.policy.param_dtype])


def ddp_kept_bytes(spec: RunSpec) -> int:
    """DDP keeps no unsharded copy; under autocast (precision=mixed) the compute-dtype casts of
    the weights are cached from forward to backward."""
    p = spec.policy
    if p.compute_dtype == p.param_dtype:
        return 0
    return count_params(spec.model) * DTYPE_BYTES[p.compute_dtype]


def ddp_phase_peaks(spec: RunSpec, *, params: int, grads: int, acts: int, saved: int,
                    gloo: bool, step: int, loss: LossBytes) -> dict[str, int]:
    """full fine-tuning's phase peaks for sharding=no_shard (DDP): the gradients live in DDP's
    buckets for the whole run (gradient_as_bucket_view), so they are part of the state in every
    phase; nothing is gathered; one bucket is all-reduced at a time (gloo copies it); ``params``
    holds the params and optimizer state, ``step`` is the optimizer step's temporary
    (plan/optimizer.py), ``loss`` the loss path's terms (plan/loss.py)."""
    m, t, c = spec.model, spec.train, DTYPE_BYTES[spec.policy.compute_dtype]
    tokens, hidden = t.batch_size * t.seq_len, m.hidden_size
    state = params + grads + ddp_kept_bytes(spec)
    # autocast (precision=mixed) leaves the residual stream in the param dtype: the saved inputs
    # of each layer (two per layer, one per checkpointed layer) and of the final norm are wider
    # than the activation model's compute dtype
    wide = DTYPE_BYTES[spec.policy.param_dtype] - c
    if wide > 0:
        wrapped = len(spec.checkpointing.wrapped_layers(m.num_layers))
        on_device, _ = checkpointed_inputs(spec.checkpointing, m.num_layers, spec.device)
        residual = tokens * hidden * wide * (2 * (m.num_layers - wrapped) + on_device + 1)
        saved, acts = saved + residual, acts + residual
    bucket = ddp_bucket_bytes(spec) if gloo else 0
    layer = numel(layer_shapes(m))
    before = state + saved + loss.head_grad
    return {
        FORWARD: before + loss.at_head,
        LOSS: before + loss.peak,
        LAYERS: state + max(saved + loss.head_grad + loss.head_backward,
                              acts + layer * c + bucket),
        ROOT: state + bucket,
        OPTIMIZER: state + step,
    }
