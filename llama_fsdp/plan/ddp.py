"""The memory model of sharding=no_shard (composable DDP): a full replica per rank, gradients
in DDP's buckets, one bucket all-reduced at a time."""
from __future__ import annotations

from ..precision import DTYPE_BYTES
from ..spec import RunSpec
from ..strategies import DDP_BUCKET_MB
from .activations import _grad_logits_bytes, logits_loss_bytes
from .shapes import count_params, layer_shapes, numel


def _ddp_bucket_bytes(spec: RunSpec) -> int:
    """One DDP bucket: the gradients, in param dtype, up to the bucket cap."""
    return min(DDP_BUCKET_MB * 2**20,
               count_params(spec.model) * DTYPE_BYTES[spec.policy.param_dtype])


def _ddp_kept(spec: RunSpec) -> int:
    """DDP keeps no unsharded copy; under autocast (precision=mixed) the compute-dtype casts of
    the weights are cached from forward to backward."""
    p = spec.policy
    if p.compute_dtype == p.param_dtype:
        return 0
    return count_params(spec.model) * DTYPE_BYTES[p.compute_dtype]


def _ddp_phase_peaks(spec: RunSpec, *, params: int, grads: int, optim: int, acts: int,
                     saved: int, gloo: bool, step: int) -> dict[str, int]:
    """phase_peaks for sharding=no_shard (DDP): the gradients live in DDP's buckets for the
    whole run (gradient_as_bucket_view), so they are part of the state in every phase; nothing
    is gathered; one bucket is all-reduced at a time (gloo copies it); ``step`` is the optimizer
    step's temporary (plan/optimizer.py)."""
    m, t, c = spec.model, spec.train, DTYPE_BYTES[spec.policy.compute_dtype]
    tokens, vocab, hidden = t.batch_size * t.seq_len, m.vocab_size, m.hidden_size
    state = params + optim + grads + _ddp_kept(spec)
    # autocast (precision=mixed) leaves the residual stream in the param dtype: the saved inputs
    # of each layer (two per layer, one per checkpointed layer) and of the final norm are wider
    # than the activation model's compute dtype
    wide = DTYPE_BYTES[spec.policy.param_dtype] - c
    if wide > 0:
        wrapped = len(spec.checkpointing.wrapped_layers(m.num_layers))
        residual = tokens * hidden * wide * (2 * (m.num_layers - wrapped) + wrapped + 1)
        saved, acts = saved + residual, acts + residual
    bucket = _ddp_bucket_bytes(spec) if gloo else 0
    grad_logits_fp32 = _grad_logits_bytes(c, tokens, vocab)
    layer = numel(layer_shapes(m))
    return {
        "forward": state + saved + c * tokens * vocab,
        "loss": state + saved + max(
            logits_loss_bytes(m, micro_batch=t.batch_size, seq_len=t.seq_len, c=c),
            grad_logits_fp32),
        "layers": state + max(saved + c * tokens * (vocab + hidden),
                              acts + layer * c + bucket),
        "root": state + bucket,
        "optimizer": state + step,
    }
