"""Per-device memory of a training step: the components (``Memory``) and what is live at the
peak of each phase of a step (``phase_peaks``), for FSDP2 in parallel.py's groups; DDP's model is
in ddp.py."""
from __future__ import annotations

from dataclasses import dataclass

from ..spec import DTYPE_BYTES, RunSpec
from .activations import _grad_logits_bytes, activation_bytes, logits_loss_bytes, saved_layer_bytes
from .ddp import _ddp_bucket_bytes, _ddp_kept, _ddp_phase_peaks
from .optimizer import optimizer_state_bytes, optimizer_step_bytes
from .shapes import count_params, layer_shapes, numel, param_shapes, root_shapes, sharded_numel


@dataclass(frozen=True)
class Memory:
    """Per-device sizes of the components of a training step's memory.

    They are never all live at once (grads are None until the first reduce-scatter, the
    all-gather / reduce-scatter buffers and the recomputed layer come and go during backward),
    so ``total``, their sum, mostly over-states the peak (by 10-37% on CPU, see
    benchmarks/plan_vs_measured_cpu.md), and it misses foreach AdamW's param-sized temporary.
    The prediction is ``phase_peaks``'s maximum (``Plan.predicted_peak_bytes``).
    """

    params: int  # sharded parameters (param dtype)
    grads: int  # sharded gradients (param dtype)
    optimizer: int  # AdamW exp_avg + exp_avg_sq (param dtype, or low-bit: plan/optimizer.py)
    unsharded_params: int  # reshard_after_forward=False: all params in compute dtype
    comm_buffers: int  # all-gather / reduce-scatter in flight; the largest unit's too
    activations: int
    logits_loss: int
    host: int = 0  # cpu_offload: sharded params, grads, optimizer state in host RAM

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        """The sum of the components: an upper bound, not the predicted peak."""
        return (self.model_state + self.unsharded_params + self.comm_buffers + self.activations
                + self.logits_loss)


def model_state_bytes(spec: RunSpec) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes one rank holds for its shards, wherever they live."""
    if spec.finetune.adapters:  # a frozen base: plan/adapters.py
        from . import adapters

        return adapters.model_state_bytes(spec)
    local = sharded_numel(param_shapes(spec.model), spec.mesh.shard)
    b = DTYPE_BYTES[spec.policy.param_dtype]
    return local * b, local * b, optimizer_state_bytes(spec)


def _comm_bytes(spec: RunSpec) -> int:
    """Two layers in flight (current + prefetched): unsharded params (unless kept anyway) and
    grads in compute dtype, and the largest unit's unsharded params, grads and reduce-scatter
    input. Untied (parallel.py's groups) that unit is [norm, head], gathered from its forward
    to its backward (the embedding, as large, is never gathered in backward); tied, the root
    (embedding, norm, head), gathered once for forward and kept through backward, with one
    reduce-scatter input counted layer-sized (the phase model has the root's in full)."""
    m, p = spec.model, spec.policy
    c, r = DTYPE_BYTES[p.compute_dtype], DTYPE_BYTES[p.reduce_dtype]
    layer = numel(layer_shapes(m))
    if spec.mesh.ddp:  # one gradient bucket being all-reduced
        return _ddp_bucket_bytes(spec)
    if m.tie_word_embeddings:
        largest, largest_rs = numel(root_shapes(m)), layer
    else:
        largest = m.vocab_size * m.hidden_size + m.hidden_size
        largest_rs = max(largest, layer)
    params = 0 if not spec.mesh.reshard_after_forward else (2 * layer + largest) * c
    return params + (2 * layer + largest) * c + largest_rs * r


def memory_breakdown(spec: RunSpec) -> Memory:
    """Per-device memory of one training step of this spec."""
    if spec.finetune.adapters:  # a frozen base: plan/adapters.py
        from . import adapters

        return adapters.memory_breakdown(spec)
    params, grads, optim = model_state_bytes(spec)
    c = DTYPE_BYTES[spec.policy.compute_dtype]
    t, ac = spec.train, spec.checkpointing
    host = 0
    if spec.sharding.cpu_offload:
        host, params, grads, optim = params + grads + optim, 0, 0, 0
    if spec.mesh.ddp:
        kept = _ddp_kept(spec)
    else:
        kept = 0 if spec.mesh.reshard_after_forward else count_params(spec.model) * c
    return Memory(
        params=params, grads=grads, optimizer=optim, unsharded_params=kept,
        comm_buffers=_comm_bytes(spec),
        activations=activation_bytes(spec.model, micro_batch=t.batch_size, seq_len=t.seq_len,
                                     c=c, ac=ac, packing=spec.data.packing,
                                     device=spec.device),
        logits_loss=logits_loss_bytes(spec.model, micro_batch=t.batch_size, seq_len=t.seq_len,
                                      c=c),
        host=host,
    )


# ---------------------------------------------------------------------------------------------
# Peak per phase of a training step
#
# The predicted peak is the largest of what is live in each phase of a step, from the second
# step on (with optimizer state), checked against real CPU gloo ranks in
# benchmarks/plan_vs_measured_cpu.md and by tests/multirank/test_plan_memory.py.

PHASES = ("forward", "loss", "layers", "root", "optimizer")


def phase_peaks(spec: RunSpec, *, gloo: bool) -> dict[str, int]:
    """Bytes per rank at the peak of each phase of a training step (from the second step on,
    with optimizer state; grads are None between steps: zero_grad(set_to_none=True), so they
    are live before the backward only with gradient accumulation).

    ``gloo`` adds the copy of its input that gloo's reduce-scatter makes (NCCL reduces in
    place); make_plan passes it for CPU runs. An untied model is sharded in torchtitan's groups
    (parallel.apply_fsdp) and has its own model: ``_grouped_phase_peaks``. A tied embedding
    stays in the root unit; per phase, what is live besides params + optimizer state:

    forward   (at the head) saved activations, unsharded params kept (all of them without
              resharding, else the last layer, which parallel.py never reshards), the root's
              unsharded params (never resharded after forward: FSDP2's default for the root),
              2 layers being all-gathered (output buffer + copy-out), the logits in compute
              dtype;
    loss      the root still unsharded, and the plan's logits + loss buffers or the fp32 grad
              of the logits and its compute-dtype cast;
    layers    the head's grad, then either the lm_head backward (saved activations, grad of
              logits and of hidden, the root unsharded) or a layer's backward (all
              activations, a checkpointed layer recomputed; the root still unsharded, sharded
              layer grads so far, 2 layers in flight, one layer's unsharded grads, its
              reduce-scatter input, gloo's copy of it);
    root      all sharded grads and the root's unsharded grads, with either its unsharded
              params during the embedding's backward (a tied embedding's grad is made beside
              the head's and added to it out of place: 2 more) or, once resharded, its
              reduce-scatter input (the largest group: embedding + head), gloo's copy of it
              and, with accumulation, the new grad shard added to the old;
    optimizer params, grads, both moments and the step's temporary (foreach AdamW's
              denominator, one param-size temporary; a low-bit step's fp32 copies of the
              largest parameter: plan/optimizer.py's optimizer_step_bytes).

    sharding=no_shard is DDP, with its own model: ``_ddp_phase_peaks``.

    Activations include the packed sequences' mask term when data.packing is true (see
    ``packed_mask_bytes``), in every phase that holds saved activations.
    """
    if spec.objective.name == "dpo":  # the reference beside the policy: plan/preference.py
        from . import preference

        return preference.phase_peaks(spec, gloo=gloo)
    if spec.finetune.adapters:  # a frozen base: plan/adapters.py
        from . import adapters

        return adapters.phase_peaks(spec, gloo=gloo)
    m, pol, t, ac, mesh = spec.model, spec.policy, spec.train, spec.checkpointing, spec.mesh
    c, r = DTYPE_BYTES[pol.compute_dtype], DTYPE_BYTES[pol.reduce_dtype]
    params, grads, optim = model_state_bytes(spec)
    step = optimizer_step_bytes(spec)
    if spec.sharding.cpu_offload:
        params = grads = optim = step = 0
    layer, root = numel(layer_shapes(m)), numel(root_shapes(m))
    tokens, vocab, hidden = t.batch_size * t.seq_len, m.vocab_size, m.hidden_size
    resharded = mesh.reshard_after_forward
    kept = layer * c if resharded else count_params(m) * c
    packing = spec.data.packing
    acts = activation_bytes(m, micro_batch=t.batch_size, seq_len=t.seq_len, c=c, ac=ac,
                            packing=packing, device=spec.device)
    wrapped = len(ac.wrapped_layers(m.num_layers))
    # the layer recomputed in backward is not live before it
    recomputed = tokens * saved_layer_bytes(m, seq_len=t.seq_len, c=c, packing=packing,
                                            device=spec.device)
    saved = acts - (recomputed if wrapped else 0)
    if mesh.ddp:
        return _ddp_phase_peaks(spec, params=params, grads=grads, optim=optim, acts=acts,
                                saved=saved, gloo=gloo, step=step)
    in_flight = 2 * layer * c if resharded else 0
    rs_copies = 2 if gloo else 1
    if not m.tie_word_embeddings:
        return _grouped_phase_peaks(spec, params=params, grads=grads, optim=optim, acts=acts,
                                    saved=saved, kept=kept, in_flight=in_flight,
                                    rs_copies=rs_copies, step=step)
    root_unsharded = root * c if resharded else 0
    layer_grads = (0 if spec.sharding.cpu_offload else
                   sharded_numel(layer_shapes(m) * m.num_layers, mesh.shard)
                   * DTYPE_BYTES[pol.param_dtype])
    grad_logits_fp32 = _grad_logits_bytes(c, tokens, vocab)
    # tied embedding: the embedding's grad is made beside the head's and added out of place
    tied_grad = 2 * vocab * hidden * c if m.tie_word_embeddings else 0
    # gradient accumulation: the sharded grads of earlier micro-batches stay through the step
    accumulated = grads if t.grad_accum > 1 else 0
    # ... and each reduce-scatter's output is added to them
    new_root_shard = sharded_numel(root_shapes(m), mesh.shard) * r if accumulated else 0
    state = params + optim
    return {
        "forward": state + accumulated + saved + kept + root_unsharded + in_flight
        + c * tokens * vocab,
        "loss": state + accumulated + saved + kept + root_unsharded + max(
            logits_loss_bytes(m, micro_batch=t.batch_size, seq_len=t.seq_len, c=c),
            grad_logits_fp32),
        "layers": state + kept + vocab * hidden * c + max(
            saved + accumulated + root_unsharded + c * tokens * (vocab + hidden),
            acts + root_unsharded + (accumulated or layer_grads) + in_flight + layer * c
            + rs_copies * layer * r),
        "root": state + grads + max(2 * root * c + tied_grad,
                                    root * c + rs_copies * root * r + new_root_shard),
        "optimizer": state + grads + step,
    }


def _grouped_phase_peaks(spec: RunSpec, *, params: int, grads: int, optim: int, acts: int,
                         saved: int, kept: int, in_flight: int, rs_copies: int,
                         step: int) -> dict[str, int]:
    """phase_peaks for an untied model in parallel.py's groups: the embedding alone (never
    gathered in backward), the layers, [norm, head] kept gathered from its forward to its
    backward, a root without parameters. Per phase, besides params + optimizer state:

    forward   (at the head) saved activations, the unsharded params kept (the last layer, or
              all of them under grad_op), the head's unsharded params and its all-gather
              output (held until the root's post-forward), the logits;
    loss      the same less the all-gather output, with the logits + loss buffers;
    layers    the head's backward (its unsharded params and grad beside the logits' and the
              hidden's grads), its reduce-scatter once resharded (grad, input, gloo's copy,
              the new shard), or a layer's backward as in phase_peaks (no root held);
    root      all sharded grads, the embedding's unsharded grad and its reduce-scatter (no
              all-gather: the embedding's backward needs only the token ids);
    optimizer params, grads, both moments and the step's temporary (``step``).

    Checked against the untied FSDP configs of benchmarks/plan_vs_measured_cpu.md."""
    m, pol, t, mesh = spec.model, spec.policy, spec.train, spec.mesh
    c, r = DTYPE_BYTES[pol.compute_dtype], DTYPE_BYTES[pol.reduce_dtype]
    tokens, vocab, hidden = t.batch_size * t.seq_len, m.vocab_size, m.hidden_size
    layer = numel(layer_shapes(m))
    embed, head = vocab * hidden, vocab * hidden + hidden
    # the head's unsharded params: from its all-gather in forward to its backward (under
    # grad_op ``kept`` holds every unit already)
    head_kept = head * c if mesh.reshard_after_forward else 0
    # what stays unsharded once the head is resharded after its backward
    after_head = kept - (0 if mesh.reshard_after_forward else head * c)
    accumulated = grads if t.grad_accum > 1 else 0
    # the sharded grads made so far (param dtype; in host RAM with cpu_offload)
    stored = 0 if spec.sharding.cpu_offload else DTYPE_BYTES[pol.param_dtype]
    layer_grads = sharded_numel(layer_shapes(m) * m.num_layers, mesh.shard) * stored
    head_local = sharded_numel([(vocab, hidden), (hidden,)], mesh.shard)
    head_grad = head_local * stored
    # a reduce-scatter's output shard (reduce dtype)
    head_shard = head_local * r
    embed_shard = sharded_numel([(vocab, hidden)], mesh.shard) * r
    state = params + optim
    return {
        # at the head: its all-gather output is held beside the copied-out params until the
        # root's post-forward
        "forward": state + accumulated + saved + kept + head_kept + head * c + c * tokens * vocab,
        "loss": state + accumulated + saved + kept + head_kept
        + logits_loss_bytes(m, micro_batch=t.batch_size, seq_len=t.seq_len, c=c),
        "layers": state + max(
            # the head's backward: its unsharded grad beside the logits' and the hidden's
            kept + saved + accumulated + head_kept + head * c + c * tokens * (vocab + hidden),
            # its reduce-scatter (the grad is still referenced beside the input, gloo's copy
            # and the new shard)
            after_head + saved + accumulated + c * tokens * hidden + head * c
            + rs_copies * head * r + head_shard,
            # a layer's backward
            after_head + acts + (accumulated or layer_grads + head_grad) + in_flight + layer * c
            + rs_copies * layer * r),
        # the embedding's grad (no all-gather: its backward needs only the ids), then its
        # reduce-scatter input and gloo's copy, beside the sharded grads. ``grads`` holds the
        # new shard already; one shard more covers a buffer measured beside them and not yet
        # identified (benchmarks/plan_vs_measured_cpu.md), and with accumulation the new
        # shard is added to the old one out of place
        "root": state + grads + embed * c + rs_copies * embed * r
        + embed_shard * (2 if accumulated else 1),
        "optimizer": state + grads + step,
    }


def phase_peak_bytes(spec: RunSpec, *, gloo: bool) -> int:
    """The largest of phase_peaks: the predicted peak per rank."""
    return max(phase_peaks(spec, gloo=gloo).values())
