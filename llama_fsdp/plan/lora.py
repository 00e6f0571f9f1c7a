"""The plan of finetune=lora | qlora: a frozen base with no gradients and no optimizer state
(16-bit, or for qlora NF4 on the target projections, scales included), adapters that have
both, fewer saved activations, and fewer FLOPs (no weight gradients over the base).

fit.py hands a spec with adapters to ``lora_state_bytes``, ``lora_memory_breakdown``,
``lora_phase_peaks`` and ``lora_flops_per_token`` here (full.py has full fine-tuning's); the
phases are full fine-tuning's less what a frozen weight never has, plus the NF4 terms. Checked
against real gloo ranks in benchmarks/plan_vs_measured_cpu.md and
tests/multirank/test_plan_memory.py.
"""
from __future__ import annotations

import math

from ..config import nf4
from ..config.kernels import VARLEN
from ..config.schema import FinetuneConfig, ModelConfig
from ..config.precision import DTYPE_BYTES
from ..run.spec import RunSpec
from ..config.strategies import DDP_BUCKET_MB
from .activations import (
    checkpointed_inputs,
    layer_activation_bytes,
    packed_mask_bytes,
    varlen_backward_extra,
    varlen_mask_bytes,
)
from .loss import LossBytes, loss_bytes
from .phases import FORWARD, LAYERS, LOSS, Memory, OPTIMIZER, ROOT, alone, reduce_scatter_copies
from .shapes import count_params, n_matmul, numel, projection_shapes, root_shapes, sharded_numel

QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


def adapter_shapes(m: ModelConfig, ft: FinetuneConfig) -> list[tuple[int, int]]:
    """One decoder layer's adapters: A (rank x in) and B (out x rank) per target."""
    out: list[tuple[int, int]] = []
    for name, (rows, cols) in projection_shapes(m).items():
        if name in ft.target_modules:
            out += [(ft.rank, cols), (rows, ft.rank)]
    return out


def adapter_params(m: ModelConfig, ft: FinetuneConfig) -> int:
    return numel(adapter_shapes(m, ft)) * m.num_layers


def lora_flops_per_token(m: ModelConfig, ft: FinetuneConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token with a frozen base: 2N forward and 2N for the input
    gradients, no weight gradients (4 N_matmul), 6 N_a for the adapters, and attention as
    full fine-tuning (12 L H Q T). The input gradient of layer 0's frozen projections, which
    nothing needs, is counted: it is a 1/L share, and the convention counts matmuls."""
    q = m.hidden_size // m.num_heads
    return (4.0 * n_matmul(m) + 6.0 * adapter_params(m, ft)
            + 12.0 * m.num_layers * m.num_heads * q * seq_len)


def _frozen_layer_shapes(m: ModelConfig, ft: FinetuneConfig) -> list[tuple[int, ...]]:
    """One layer's frozen 16-bit weights: every projection (lora) or those not stored in NF4
    (qlora), and the two RMSNorm weights."""
    shapes = [s for name, s in projection_shapes(m).items()
              if not (ft.nf4 and name in ft.target_modules)]
    return shapes + [(m.hidden_size,), (m.hidden_size,)]


def _nf4_layer_bytes(spec: RunSpec, shard: int) -> int:
    """One layer's NF4 weights (qlora's targets) per rank over ``shard`` ranks."""
    ft = spec.finetune
    if not ft.nf4:
        return 0
    f = DTYPE_BYTES[spec.policy.frozen_dtype]
    return sum(nf4.shard_bytes(rows * cols, dtype_bytes=f, block_size=ft.nf4_block_size,
                               scaler_block_size=ft.nf4_scaler_block_size, shard=shard)
               for name, (rows, cols) in projection_shapes(spec.model).items()
               if name in ft.target_modules)


def base_bytes(spec: RunSpec) -> int:
    """The frozen base one rank holds: 16-bit weights sharded as FSDP2 pads them, NF4 shards
    (a full copy per rank under sharding=no_shard)."""
    m, shard = spec.model, spec.mesh.shard
    f = DTYPE_BYTES[spec.policy.frozen_dtype]
    plain = sharded_numel(root_shapes(m) + _frozen_layer_shapes(m, spec.finetune) * m.num_layers,
                          shard)
    return plain * f + _nf4_layer_bytes(spec, shard) * m.num_layers


def lora_state_bytes(spec: RunSpec) -> tuple[int, int, int]:
    """(params, grads, optimizer) one rank holds: the base and its adapters' shards; the
    adapters' gradients; AdamW's two moments of the adapters."""
    a = sharded_numel(adapter_shapes(spec.model, spec.finetune) * spec.model.num_layers,
                      spec.mesh.shard) * DTYPE_BYTES[spec.policy.param_dtype]
    return base_bytes(spec) + a, a, 2 * a


# --- activations -----------------------------------------------------------------------------


def lora_layer_activation_bytes(m: ModelConfig, ft: FinetuneConfig, c: int,
                                device: str = "cuda") -> int:
    """Saved-for-backward bytes per token of one decoder layer with a frozen base.

    From the full layer's (activations.py): the RMSNorms' x·rsqrt is not kept (their weights
    are frozen: -2hc); a frozen Linear keeps no input, so the input of q/k/v, of gate/up and of
    down is kept only where one of them has an adapter (lora_A keeps it); each adapter keeps
    A x, rank wide (r·c). With dropout, each adapter keeps its dropped input and the mask (a
    c-byte mask on CPU, bool on CUDA) instead of the shared input. An NF4 base adds nothing:
    torchao's linear_nf4 keeps only the weight. Exact against the bytes autograd saves
    (tests/unit/test_plan_adapters.py) when a q, k or v projection has an adapter; without
    one, no gradient reaches layer 0's attention and it keeps less (the plan is above by less
    than a layer).
    """
    h, i = m.hidden_size, m.intermediate_size
    targets, shapes = set(ft.target_modules), projection_shapes(m)
    inputs = (h * bool(targets & set(QKV)) + h * bool(targets & set(GATE_UP))
              + i * ("down_proj" in targets))
    out = layer_activation_bytes(m, c) - 2 * h * c - (2 * h + i) * c + inputs * c
    out += c * ft.rank * len(targets)
    if ft.dropout > 0:
        mask = _mask_bytes(c, device)
        out += sum((c + mask) * shapes[t][1] for t in targets) - inputs * c
    return out


def _mask_bytes(c: int, device: str) -> int:
    """Bytes per element of a dropout mask: bool on CUDA, the input's dtype on CPU."""
    return 1 if device == "cuda" else c


def lora_saved_layer_bytes(m: ModelConfig, ft: FinetuneConfig, *, seq_len: int, c: int,
                           packing: bool, device: str) -> int:
    """Saved-for-backward bytes per token of one (not checkpointed) layer with adapters, with
    the packed sequences' terms (activations.saved_layer_bytes' with a frozen base)."""
    varlen = m.attn_implementation == VARLEN
    extra = (packed_mask_bytes(m, seq_len, c, m.attn_implementation, device)
             if packing or varlen else 0)
    return lora_layer_activation_bytes(m, ft, c, device) + extra


def lora_activation_bytes(spec: RunSpec) -> int:
    """Activations one micro-batch keeps for backward (activations.activation_bytes with the
    layer above). Outside the layers only the loss's int64 targets are kept: the final
    RMSNorm's fp32 input and rsqrt (4h + 4) are what layer 0's first RMSNorm, whose input
    needs no gradient with a frozen embedding, does not keep, and neither the embedding nor
    the frozen head keeps its input."""
    m, t, ft = spec.model, spec.train, spec.finetune
    c = DTYPE_BYTES[spec.policy.compute_dtype]
    per_layer = lora_saved_layer_bytes(m, ft, seq_len=t.seq_len, c=c,
                                       packing=spec.data.packing, device=spec.device)
    wrapped = len(spec.checkpointing.wrapped_layers(m.num_layers))
    on_device, _ = checkpointed_inputs(spec.checkpointing, m.num_layers, spec.device)
    layers = (m.num_layers - wrapped) * per_layer + on_device * c * m.hidden_size
    if wrapped:
        layers += per_layer  # the layer being recomputed in backward
    outside = 8 + varlen_mask_bytes(m, t.seq_len, c, spec.device)  # the loss's int64 targets
    if ft.dropout > 0 and 0 not in spec.checkpointing.wrapped_layers(m.num_layers):
        # layer 0's q / k / v dropouts keep no mask: their input needs no gradient
        outside -= m.hidden_size * _mask_bytes(c, spec.device) * len(set(ft.target_modules)
                                                                      & set(QKV))
    rope = 2 * t.seq_len * (m.hidden_size // m.num_heads) * c
    return t.batch_size * t.seq_len * (layers + outside) + rope


# --- the phases of a step --------------------------------------------------------------------


def _unsharded_layer_bytes(spec: RunSpec) -> int:
    """One layer all-gathered: 16-bit weights and adapters in the compute dtype, NF4 weights in
    NF4 (gathered in 4 bits; with a one-rank shard group they are not gathered at all)."""
    m, ft, c = spec.model, spec.finetune, DTYPE_BYTES[spec.policy.compute_dtype]
    plain = numel(_frozen_layer_shapes(m, ft)) + numel(adapter_shapes(m, ft))
    return plain * c + (_nf4_layer_bytes(spec, 1) if spec.mesh.shard > 1 else 0)


def _dequantized_bytes(spec: RunSpec) -> int:
    """qlora: the largest target weight dequantized inside its matmul (forward, and again for
    the input gradient in backward), one weight at a time: nf4.linear decodes it a chunk at a
    time into its compute-dtype result (nf4.dequantize_bytes: c bytes a weight plus one
    chunk's (8 + 2c) bytes an element; measured as planned, benchmarks/long_context.md's
    "The NF4 weight inside its matmul")."""
    ft = spec.finetune
    if not ft.nf4:
        return 0
    shapes = projection_shapes(spec.model)
    return nf4.dequantize_bytes(max(math.prod(shapes[t]) for t in ft.target_modules),
                                dtype_bytes=DTYPE_BYTES[spec.policy.compute_dtype],
                                block_size=ft.nf4_block_size,
                                scaler_block_size=ft.nf4_scaler_block_size)


def lora_phase_peaks(spec: RunSpec, *, gloo: bool) -> dict[str, int]:
    """Bytes per rank at the peak of each phase (full.full_phase_peaks, whose docstrings
    explain the phases), with a frozen base: no gradient of the base, the embedding or the
    head, so no head gradient in its backward, no reduce-scatter but the adapters', no
    embedding backward at all (the root phase holds the state and the adapters' gradients);
    the optimizer phase's foreach temporary is adapter-sized. qlora adds a dequantized weight
    inside a layer's forward and backward; the forward's peak may be at its start (the first
    unit gathered) or inside a layer rather than at the head."""
    m, pol, t, mesh, ft = spec.model, spec.policy, spec.train, spec.mesh, spec.finetune
    c, r = DTYPE_BYTES[pol.compute_dtype], DTYPE_BYTES[pol.reduce_dtype]
    params, grads, optim = lora_state_bytes(spec)
    adapters = grads  # sharded, param dtype
    if spec.sharding.cpu_offload:
        params = grads = optim = 0
    tokens, hidden = t.batch_size * t.seq_len, m.hidden_size
    acts = lora_activation_bytes(spec)
    wrapped = len(spec.checkpointing.wrapped_layers(m.num_layers))
    recomputed = tokens * lora_saved_layer_bytes(m, ft, seq_len=t.seq_len, c=c,
                                                 packing=spec.data.packing, device=spec.device)
    saved = acts - (recomputed if wrapped else 0)
    # a layer's backward also holds flash varlen's workspace (CUDA): ``acts`` is used there only
    acts += varlen_backward_extra(m, micro_batch=t.batch_size, seq_len=t.seq_len, c=c,
                                  device=spec.device, records=spec.records_per_micro_batch)
    accumulated = grads if t.grad_accum > 1 else 0
    state = params + optim
    lb = loss_bytes(spec, head_trains=False)
    a_layer = numel(adapter_shapes(m, ft))
    if mesh.ddp:
        return _lora_ddp_phase_peaks(spec, state=state, grads=grads, adapters=adapters,
                                     acts=acts, saved=saved, loss=lb, gloo=gloo)
    layer_u = _unsharded_layer_bytes(spec)
    root_u = numel(root_shapes(m)) * c
    resharded = mesh.reshard_after_forward
    kept = layer_u if resharded else layer_u * m.num_layers + root_u
    in_flight = 2 * layer_u if resharded else 0
    # a layer's backward: its adapters' unsharded grads and their reduce-scatter (gloo copies
    # the input), the dequantized weight of qlora
    layer_bwd = (acts + (accumulated or grads) + in_flight + a_layer * c
                 + reduce_scatter_copies(spec, gloo=gloo) * a_layer * r
                 + _dequantized_bytes(spec))
    # inside a layer's forward (the peak where the logits are small and qlora's dequantized
    # weight large): the layers before, this layer's activations, its dequantized weight
    in_layer = (state + accumulated + saved + (recomputed if wrapped else 0) + kept + in_flight
                + _dequantized_bytes(spec))
    # the start of forward: the first unit (the tied root, or the embedding) all-gathered (its
    # output buffer beside the copied-out parameters, but one copy in a group of one) while the
    # first layers are prefetched
    first = numel(root_shapes(m)) * c if m.tie_word_embeddings else m.vocab_size * hidden * c
    start = state + accumulated + (1 if alone(spec) else 2) * first + in_flight
    # No embedding backward: the step ends with layer 0's, whose input needs no gradient, so
    # FSDP2 reduce-scatters its adapters' gradients and reshards it only in its final callback:
    # layer 0 still gathered, the gradients of q, k, v's outputs and their input
    q = m.hidden_size // m.num_heads
    root = (state + grads + layer_u
            + c * tokens * (hidden + m.num_heads * q + 2 * m.num_kv_heads * q))
    if m.tie_word_embeddings:  # the root (embedding, norm, head) stays gathered throughout
        root_kept = root_u if resharded else 0
        before = state + accumulated + saved + kept + root_kept
        return {
            FORWARD: max(start, in_layer + root_kept, before + in_flight + lb.at_head),
            LOSS: before + lb.peak,
            LAYERS: state + kept + root_kept + max(
                saved + accumulated + lb.head_backward, layer_bwd),
            ROOT: root + root_kept, OPTIMIZER: state + grads + adapters}
    head = (m.vocab_size * hidden + hidden) * c
    head_kept = head if resharded else 0
    after_head = kept - (0 if resharded else head)
    before = state + accumulated + saved + kept + head_kept
    gathered = 0 if alone(spec) else head  # the head's all-gather output, held (full.py)
    return {
        FORWARD: max(start, in_layer, before + gathered + lb.at_head),
        LOSS: before + (gathered if lb.in_head_forward else 0) + lb.peak,
        LAYERS: state + max(before - state + lb.head_backward, after_head + layer_bwd),
        ROOT: root, OPTIMIZER: state + grads + adapters}


def _lora_ddp_phase_peaks(spec: RunSpec, *, state: int, grads: int, adapters: int, acts: int,
                          saved: int, loss: LossBytes, gloo: bool) -> dict[str, int]:
    """sharding=no_shard (DDP, ddp.py's model) with a frozen base: the adapters' gradients in
    DDP's buckets all along, their compute-dtype casts cached under autocast (mixed), one
    bucket all-reduced at a time (gloo copies it)."""
    m, pol = spec.model, spec.policy
    c = DTYPE_BYTES[pol.compute_dtype]
    a_layer = numel(adapter_shapes(m, spec.finetune))
    kept = a_layer * m.num_layers * c if pol.compute_dtype != pol.param_dtype else 0
    bucket = min(grads, DDP_BUCKET_MB * 2**20) if gloo else 0
    state += grads + kept
    return {FORWARD: state + saved + loss.at_head,
            LOSS: state + saved + loss.peak,
            LAYERS: state + max(saved + loss.head_backward,
                                  acts + _dequantized_bytes(spec) + a_layer * c + bucket),
            ROOT: state + bucket, OPTIMIZER: state + adapters}


def lora_memory_breakdown(spec: RunSpec) -> Memory:
    """full.full_memory_breakdown with a frozen base: gradients and optimizer state of the
    adapters only, unsharded copies of layers in the compute dtype (NF4 in 4 bits), buffers of
    the adapters' reduce-scatter."""
    m, pol, mesh, ft = spec.model, spec.policy, spec.mesh, spec.finetune
    c, r = DTYPE_BYTES[pol.compute_dtype], DTYPE_BYTES[pol.reduce_dtype]
    params, grads, optim = lora_state_bytes(spec)
    host = 0
    if spec.sharding.cpu_offload:
        host, params, grads, optim = params + grads + optim, 0, 0, 0
    a_layer, layer_u = numel(adapter_shapes(m, ft)), _unsharded_layer_bytes(spec)
    largest = (numel(root_shapes(m)) if m.tie_word_embeddings
               else m.vocab_size * m.hidden_size + m.hidden_size) * c
    if mesh.ddp:
        kept = a_layer * m.num_layers * c if pol.compute_dtype != pol.param_dtype else 0
        comm = min(a_layer * m.num_layers * DTYPE_BYTES[pol.param_dtype], DDP_BUCKET_MB * 2**20)
    else:
        resharded = mesh.reshard_after_forward
        kept = 0 if resharded else layer_u * m.num_layers + numel(root_shapes(m)) * c
        comm = (2 * layer_u + largest if resharded else 0) + 2 * a_layer * c + a_layer * r
    return Memory(params=params, grads=grads, optimizer=optim, unsharded_params=kept,
                  comm_buffers=comm, activations=lora_activation_bytes(spec),
                  logits_loss=loss_bytes(spec, head_trains=False).peak, host=host)


def trainable_fraction(spec: RunSpec) -> float:
    """The adapters' share of all parameters (the table's line on what trains)."""
    n = adapter_params(spec.model, spec.finetune)
    return n / (count_params(spec.model) + n)
