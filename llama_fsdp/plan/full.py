"""The memory of full fine-tuning (every weight trains): the components of a step
(``full_memory_breakdown``) and what is live at the peak of each phase (``full_phase_peaks``),
for FSDP2 in model/parallelize.py's groups; DDP's model is in ddp.py, the frozen base's (lora / qlora) in
lora.py. fit.py chooses between them."""
from __future__ import annotations

from dataclasses import dataclass

from ..config.precision import DTYPE_BYTES
from ..run.spec import RunSpec
from .activations import activation_bytes, saved_layer_bytes, varlen_backward_extra
from .ddp import ddp_bucket_bytes, ddp_kept_bytes, ddp_phase_peaks
from .loss import LossBytes, loss_bytes
from .optimizer import optimizer_state_bytes, optimizer_step_bytes
from .phases import FORWARD, LAYERS, LOSS, Memory, OPTIMIZER, ROOT, alone, reduce_scatter_copies
from .shapes import count_params, layer_shapes, numel, param_shapes, root_shapes, sharded_numel


def full_state_bytes(spec: RunSpec) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes one rank holds for its shards, wherever they live."""
    local = sharded_numel(param_shapes(spec.model), spec.mesh.shard)
    b = DTYPE_BYTES[spec.policy.param_dtype]
    return local * b, local * b, optimizer_state_bytes(spec)


def _comm_bytes(spec: RunSpec) -> int:
    """Two layers in flight (current + prefetched): unsharded params (unless kept anyway) and
    grads in compute dtype, and the largest unit's unsharded params, grads and reduce-scatter
    input. Untied (model/parallelize.py's groups) that unit is [norm, head], gathered from its forward
    to its backward (the embedding, as large, is never gathered in backward); tied, the root
    (embedding, norm, head), gathered once for forward and kept through backward, with one
    reduce-scatter input counted layer-sized (the phase model has the root's in full)."""
    m, p = spec.model, spec.policy
    c, r = DTYPE_BYTES[p.compute_dtype], DTYPE_BYTES[p.reduce_dtype]
    layer = numel(layer_shapes(m))
    if spec.mesh.ddp:  # one gradient bucket being all-reduced
        return ddp_bucket_bytes(spec)
    if m.tie_word_embeddings:
        largest, largest_rs = numel(root_shapes(m)), layer
    else:
        largest = m.vocab_size * m.hidden_size + m.hidden_size
        largest_rs = max(largest, layer)
    params = 0 if not spec.mesh.reshard_after_forward else (2 * layer + largest) * c
    return params + (2 * layer + largest) * c + largest_rs * r


def full_memory_breakdown(spec: RunSpec) -> Memory:
    """Per-device memory of one training step of this spec."""
    params, grads, optim = full_state_bytes(spec)
    c = DTYPE_BYTES[spec.policy.compute_dtype]
    t, ac = spec.train, spec.checkpointing
    host = 0
    if spec.sharding.cpu_offload:
        host, params, grads, optim = params + grads + optim, 0, 0, 0
    if spec.mesh.ddp:
        kept = ddp_kept_bytes(spec)
    else:
        kept = 0 if spec.mesh.reshard_after_forward else count_params(spec.model) * c
    lb = loss_bytes(spec, head_trains=True)
    return Memory(
        params=params, grads=grads, optimizer=optim, unsharded_params=kept,
        comm_buffers=_comm_bytes(spec),
        activations=activation_bytes(spec.model, micro_batch=t.batch_size, seq_len=t.seq_len,
                                     c=c, ac=ac, packing=spec.data.packing,
                                     device=spec.device) + lb.saved_input,
        logits_loss=lb.peak + lb.head_grad, host=host)


# ---------------------------------------------------------------------------------------------
# Peak per phase of a training step
#
# The predicted peak is the largest of what is live in each phase of a step, from the second
# step on (with optimizer state), checked against real CPU gloo ranks in
# benchmarks/plan_vs_measured_cpu.md and by tests/multirank/test_plan_memory.py.

# An untied model's root phase holds one embedding shard (reduce dtype) more than its named
# buffers: measured beside the sharded grads and the embedding's reduce-scatter in every untied
# FSDP config of benchmarks/plan_vs_measured_cpu.md (its "root" column), where gloo's
# reduce-scatter itself holds only its input's copy (measured alone: input + 2 MiB). Without
# it the root phase of 2 ranks, full, mixed, AC full, b=1, chunked is 4% under the measured
# peak (tests/multirank/test_plan_memory.py's band is 2%). Which allocation holds it is not
# known; the plan counts it as measured.
ROOT_EXTRA_EMBED_SHARDS = 1


@dataclass(frozen=True)
class _Step:
    """What every phase of a full fine-tuning step is made of (bytes per rank)."""

    state: int  # sharded params + optimizer state (0 with cpu_offload: on the host)
    grads: int  # sharded grads (0 with cpu_offload)
    step: int  # the optimizer step's temporary
    acts: int  # saved activations at their most: with the recomputed layer
    saved: int  # saved activations before a checkpointed layer is recomputed
    kept: int  # unsharded params kept from forward to backward
    in_flight: int  # 2 layers being all-gathered
    rs_copies: int  # a reduce-scatter's input, and gloo's copy of it on CPU
    accumulated: int  # the sharded grads of earlier micro-batches (grad_accum > 1)
    loss: LossBytes


def _step(spec: RunSpec, *, gloo: bool) -> _Step:
    m, pol, t, ac, mesh = spec.model, spec.policy, spec.train, spec.checkpointing, spec.mesh
    c = DTYPE_BYTES[pol.compute_dtype]
    params, grads, optim = full_state_bytes(spec)
    step = optimizer_step_bytes(spec)
    if spec.sharding.cpu_offload:
        params = grads = optim = step = 0
    layer = numel(layer_shapes(m))
    lb = loss_bytes(spec, head_trains=True)
    acts = activation_bytes(m, micro_batch=t.batch_size, seq_len=t.seq_len, c=c, ac=ac,
                            packing=spec.data.packing, device=spec.device) + lb.saved_input
    # the layer recomputed in backward is not live before it
    recomputed = t.batch_size * t.seq_len * saved_layer_bytes(
        m, seq_len=t.seq_len, c=c, packing=spec.data.packing, device=spec.device)
    wrapped = len(ac.wrapped_layers(m.num_layers))
    resharded = mesh.reshard_after_forward
    # a layer's backward also holds flash varlen's workspace (CUDA): ``acts`` is used there only
    workspace = varlen_backward_extra(m, micro_batch=t.batch_size, seq_len=t.seq_len, c=c,
                                      device=spec.device, records=spec.records_per_micro_batch)
    return _Step(state=params + optim, grads=grads, step=step, acts=acts + workspace,
                 saved=acts - (recomputed if wrapped else 0),
                 kept=layer * c if resharded else count_params(m) * c,
                 in_flight=2 * layer * c if resharded else 0,
                 rs_copies=reduce_scatter_copies(spec, gloo=gloo),
                 accumulated=grads if t.grad_accum > 1 else 0, loss=lb)


def full_phase_peaks(spec: RunSpec, *, gloo: bool) -> dict[str, int]:
    """Bytes per rank at the peak of each phase of a training step (from the second step on,
    with optimizer state; grads are None between steps: zero_grad(set_to_none=True), so they
    are live before the backward only with gradient accumulation).

    ``gloo`` adds the copy of its input that gloo's reduce-scatter makes (NCCL reduces in
    place); make_plan passes it for CPU runs. The FSDP units decide the model: an untied
    model in torchtitan's groups (parallel.apply_fsdp: ``_grouped_phase_peaks``), a tied
    embedding in the root (``_tied_phase_peaks``), sharding=no_shard as DDP
    (ddp.ddp_phase_peaks). The loss path's terms are plan/loss.py's; activations include the
    packed sequences' mask term when data.packing is true (``packed_mask_bytes``), in every
    phase that holds saved activations.
    """
    s = _step(spec, gloo=gloo)
    if spec.mesh.ddp:
        return ddp_phase_peaks(spec, params=s.state, grads=s.grads, acts=s.acts, saved=s.saved,
                               gloo=gloo, step=s.step, loss=s.loss)
    if spec.model.tie_word_embeddings:
        return _tied_phase_peaks(spec, s)
    return _grouped_phase_peaks(spec, s)


def _tied_phase_peaks(spec: RunSpec, s: _Step) -> dict[str, int]:
    """A tied embedding stays in the root unit; per phase, what is live besides params +
    optimizer state:

    forward   (at the head) saved activations, unsharded params kept (all of them without
              resharding, else the last layer, which model/parallelize.py never reshards), the root's
              unsharded params (never resharded after forward: FSDP2's default for the root),
              2 layers being all-gathered (output buffer + copy-out), the loss's output
              (the logits; chunked, the grads it made);
    loss      the root still unsharded, and the loss's buffers at their peak;
    layers    the head's grad, then either the lm_head backward (saved activations, the
              loss's gradients, the root unsharded) or a layer's backward (all activations, a
              checkpointed layer recomputed; the root still unsharded, sharded layer grads so
              far, 2 layers in flight, one layer's unsharded grads, its reduce-scatter input,
              gloo's copy of it);
    root      all sharded grads and the root's unsharded grads, with either its unsharded
              params during the embedding's backward (a tied embedding's grad is made beside
              the head's and added to it out of place: 2 more) or, once resharded, its
              reduce-scatter input (the largest group: embedding + head), gloo's copy of it
              and, with accumulation, the new grad shard added to the old;
    optimizer params, grads, both moments and the step's temporary (foreach AdamW's
              denominator, one param-size temporary; a low-bit step's fp32 copies of the
              largest parameter: plan/optimizer.py's optimizer_step_bytes).
    """
    m, pol, mesh, lb = spec.model, spec.policy, spec.mesh, s.loss
    c, r = DTYPE_BYTES[pol.compute_dtype], DTYPE_BYTES[pol.reduce_dtype]
    vocab, hidden = m.vocab_size, m.hidden_size
    layer, root = numel(layer_shapes(m)), numel(root_shapes(m))
    root_unsharded = root * c if mesh.reshard_after_forward else 0
    layer_grads = (0 if spec.sharding.cpu_offload else
                   sharded_numel(layer_shapes(m) * m.num_layers, mesh.shard)
                   * DTYPE_BYTES[pol.param_dtype])
    # the embedding's grad is made beside the head's and added out of place
    tied_grad = 2 * vocab * hidden * c
    # with accumulation, each reduce-scatter's output is added to the earlier grads
    new_root_shard = sharded_numel(root_shapes(m), mesh.shard) * r if s.accumulated else 0
    before = s.state + s.accumulated + s.saved + s.kept + root_unsharded + lb.head_grad
    return {
        FORWARD: before + s.in_flight + lb.at_head,
        LOSS: before + lb.peak,
        LAYERS: s.state + s.kept + vocab * hidden * c + max(
            s.saved + s.accumulated + root_unsharded + lb.head_backward,
            s.acts + root_unsharded + (s.accumulated or layer_grads) + s.in_flight + layer * c
            + s.rs_copies * layer * r),
        ROOT: s.state + s.grads + max(2 * root * c + tied_grad,
                                        root * c + s.rs_copies * root * r + new_root_shard),
        OPTIMIZER: s.state + s.grads + s.step,
    }


def _grouped_phase_peaks(spec: RunSpec, s: _Step) -> dict[str, int]:
    """An untied model in model/parallelize.py's groups: the embedding alone (never gathered in
    backward), the layers, [norm, head] kept gathered from its forward to its backward, a root
    without parameters. Per phase, besides params + optimizer state:

    forward   (at the head) saved activations, the unsharded params kept (the last layer, or
              all of them under grad_op), the head's unsharded params and its all-gather
              output (held until the root's post-forward), the loss's output;
    loss      the same less the all-gather output, with the loss's buffers at their peak;
    layers    the head's backward (its unsharded params and grad beside the loss's
              gradients), its reduce-scatter once resharded (grad, input, gloo's copy, the
              new shard), or a layer's backward as in _tied_phase_peaks (no root held);
    root      all sharded grads, the embedding's unsharded grad and its reduce-scatter (no
              all-gather: the embedding's backward needs only the token ids);
    optimizer params, grads, both moments and the step's temporary (``step``).

    Checked against the untied FSDP configs of benchmarks/plan_vs_measured_cpu.md."""
    m, pol, t, mesh, lb = spec.model, spec.policy, spec.train, spec.mesh, s.loss
    c, r = DTYPE_BYTES[pol.compute_dtype], DTYPE_BYTES[pol.reduce_dtype]
    tokens, vocab, hidden = t.batch_size * t.seq_len, m.vocab_size, m.hidden_size
    layer = numel(layer_shapes(m))
    embed, head = vocab * hidden, vocab * hidden + hidden
    # the head's unsharded params: from its all-gather in forward to its backward (under
    # grad_op ``kept`` holds every unit already)
    head_kept = head * c if mesh.reshard_after_forward else 0
    # what stays unsharded once the head is resharded after its backward
    after_head = s.kept - (0 if mesh.reshard_after_forward else head * c)
    # the sharded grads made so far (param dtype; in host RAM with cpu_offload)
    stored = 0 if spec.sharding.cpu_offload else DTYPE_BYTES[pol.param_dtype]
    layer_grads = sharded_numel(layer_shapes(m) * m.num_layers, mesh.shard) * stored
    head_local = sharded_numel([(vocab, hidden), (hidden,)], mesh.shard)
    # a reduce-scatter's output shard (reduce dtype)
    head_shard = head_local * r
    embed_shard = sharded_numel([(vocab, hidden)], mesh.shard) * r
    before = s.state + s.accumulated + s.saved + s.kept + head_kept + lb.head_grad
    # at the head: its all-gather output is held beside the copied-out params until the root's
    # post-forward (through the chunked loss, which runs inside the head's forward); a shard
    # group of one gathers nothing (``alone``)
    gathered = 0 if alone(spec) else head * c
    return {
        FORWARD: before + gathered + lb.at_head,
        LOSS: before + (gathered if lb.in_head_forward else 0) + lb.peak,
        LAYERS: s.state + max(
            # the head's backward: its unsharded grad beside the loss's gradients
            s.kept + s.saved + s.accumulated + head_kept + head * c + lb.head_backward,
            # its reduce-scatter (the grad is still referenced beside the input, gloo's copy
            # and the new shard)
            after_head + s.saved + s.accumulated + c * tokens * hidden + head * c
            + s.rs_copies * head * r + head_shard,
            # a layer's backward
            after_head + s.acts + (s.accumulated or layer_grads + head_local * stored)
            + s.in_flight + layer * c + s.rs_copies * layer * r),
        # the embedding's grad (no all-gather: its backward needs only the ids), then its
        # reduce-scatter input and gloo's copy, beside the sharded grads (``grads`` holds the
        # new shard already) and the extra shard measured there; with accumulation the new shard is
        # added to the old one out of place
        ROOT: s.state + s.grads + embed * c + s.rs_copies * embed * r
        + embed_shard * (ROOT_EXTRA_EMBED_SHARDS + (1 if s.accumulated else 0)),
        OPTIMIZER: s.state + s.grads + s.step,
    }
