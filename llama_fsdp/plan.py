"""Know before you launch: parameters, FLOPs per token and per-device memory of a RunSpec.

Pure arithmetic on the spec (no process group, no GPU; torch is imported only to read a local
CUDA device's size). ``make_plan`` -> ``Plan``; ``check_fits`` refuses a run that cannot fit;
``choose_strategy`` / ``resolve_auto`` pick a strategy for ``sharding=auto``.

Units: ``*_gb`` values are decimal GB (1e9 bytes), as the worker's ``peak_memory_gb`` metric
(``torch.cuda.max_memory_allocated() / 1e9``); the table shows GiB beside them.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from typing import Optional

from .config import (
    CheckpointingConfig,
    ClusterConfig,
    Config,
    DataConfig,
    ModelConfig,
    PrecisionConfig,
    ShardingConfig,
    TrainConfig,
    model_preset,
)
from .spec import DTYPE_BYTES, PRECISION_POLICIES, ConfigError, RunSpec, build_spec
from .strategies import AUTO, AUTO_ORDER, DDP_BUCKET_MB, LEAST_MEMORY, STRATEGIES, mesh_for

log = logging.getLogger(__name__)

GB = 10**9
GIB = 2**30
DEFAULT_MARGIN = 0.10  # keep 10% of the device free (allocator fragmentation, CUDA context)
DEFAULT_MFU = 0.40


class PlanError(ValueError):
    """The run does not fit on its devices; the message has the numbers and the fixes."""


# ---------------------------------------------------------------------------------------------
# Shapes, parameter count, FLOPs


def layer_shapes(m: ModelConfig) -> list[tuple[int, ...]]:
    """One decoder layer's parameters (no biases, as transformers' Llama)."""
    h, q = m.hidden_size, m.hidden_size // m.num_heads
    kv = m.num_kv_heads * q
    i = m.intermediate_size
    return [(h, h), (kv, h), (kv, h), (h, h),  # q, k, v, o projections
            (i, h), (i, h), (h, i),  # gate, up, down
            (h,), (h,)]  # input and post-attention RMSNorm


def root_shapes(m: ModelConfig) -> list[tuple[int, ...]]:
    """Parameters outside the decoder layers: embedding, final norm, head (once if tied)."""
    shapes = [(m.vocab_size, m.hidden_size), (m.hidden_size,)]
    if not m.tie_word_embeddings:
        shapes.append((m.vocab_size, m.hidden_size))
    return shapes


def param_shapes(m: ModelConfig) -> list[tuple[int, ...]]:
    """Every unique parameter tensor of LlamaForCausalLM."""
    return root_shapes(m) + layer_shapes(m) * m.num_layers


def _numel(shapes: list[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


def count_params(m: ModelConfig) -> int:
    """Exact parameter count (a tied embedding counts once)."""
    return _numel(param_shapes(m))


def n_matmul(m: ModelConfig) -> int:
    """Parameters used in matmuls: all but the input embedding (kept when tied to the head)."""
    embed = m.vocab_size * m.hidden_size
    return count_params(m) - (0 if m.tie_word_embeddings else embed)


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6·N_matmul + 12·L·H·Q·T (no causal discount)."""
    q = m.hidden_size // m.num_heads
    return 6.0 * n_matmul(m) + 12.0 * m.num_layers * m.num_heads * q * seq_len


def sharded_numel(shapes: list[tuple[int, ...]], shard: int) -> int:
    """Elements one rank stores: FSDP2 splits dim 0 in ceil(d0/shard) rows and pads the last."""
    return sum(math.ceil(s[0] / shard) * math.prod(s[1:]) for s in shapes)


# ---------------------------------------------------------------------------------------------
# Activations
#
# Bytes that autograd saves for backward, per token, in transformers' LlamaDecoderLayer with SDPA
# (c = compute-dtype bytes, h = hidden, g = num_kv_heads·head_dim, i = intermediate):
#   each of the 2 RMSNorms: the fp32 upcast of its input (4h, saved by pow and mul), x·rsqrt
#     cast back before the weight (c·h, saved by the weight mul) and the weighted output,
#     saved as the next Linear's input (c·h)                            -> 2·(4h + 2c·h)
#   q, k, v after RoPE, saved by SDPA (RoPE's muls save only cos/sin);
#     GQA k/v stay at g wide: transformers passes enable_gqa=True when
#     there is no attention mask (a padding mask makes it repeat k/v to h) -> c·(h + 2g)
#   SDPA output, which is also o_proj's input (flash/SDPA writes it in
#     (b, s, heads, Q) layout, so HF's transpose(1, 2).contiguous() copies nothing) -> c·h
#   SwiGLU: gate (SiLU's input), SiLU(gate), up, and their product (down_proj's input) -> 4c·i
#   fp32 logsumexp per head (SDPA) and the 2 RMSNorm rsqrt values      -> 4·(heads + 2)
# Residual adds, views and transposes save nothing; Llama has no dropout, so no masks. Fused
# attention (flash / memory-efficient / CPU flash) keeps no s×s probabilities: there is no s²
# term (eager attention would add about (2c + 1)·heads·s per token per layer).
# Total: (8 + 6c)·h + 2c·g + 4c·i + 4·(heads + 2); bf16: 20h + 4g + 8i, which is 49h for 8B
# (Korthikanti's GPT layer: 34h + 5·heads·s). Outside the layers: the final RMSNorm (4h + 2c·h
# + 4), int64 input ids kept by the embedding (8) and RoPE cos/sin (2·s·Q·c per sequence).
# tests/unit/test_plan.py checks all of this against the bytes autograd really saves.
# Full activation checkpointing keeps only each layer's input (c·h); layer-selective wraps
# every k-th layer (floor(L/k) layers, as parallel.py). Backward recomputes one wrapped layer
# at a time, so one layer's full activations are added back while any layer is wrapped.


# Packed sequences (data.packing=true): position_ids restart at every document, so transformers
# builds a 4-D block-diagonal causal mask (b x 1 x s x s) instead of passing none. With a mask,
# SDPA no longer takes the GQA fast path: transformers repeats k and v to all heads, and SDPA
# keeps a compute-dtype copy of the b x s x s mask; both are saved for backward per layer:
#   k, v repeated from g to h wide                                      -> 2c·(h - g)
#   the mask in compute dtype, one row of s per token                   -> c·s
# per token and saved layer, i.e. layers x b x s x (2c(h - g) + c·s) bytes. Measured on CPU
# gloo ranks (benchmarks/plan_vs_measured_cpu.md, AC none): +8.7 MB (fp32, b=4, s=256),
# +12.7 MB (fp32, b=2, s=512), +6.4 MB (bf16, b=2, s=512), as this formula gives. It counts where
# the layer's other activations count: not for a checkpointed layer (which keeps its input
# only), once more for the layer recomputed in backward. The s term makes it quadratic in the
# sequence: at s=8192 it is GBs over a layer stack.


# model.attn_implementation=varlen (llama_fsdp/attention.py) takes packed rows with no b x s x s
# mask: no c·s term. On CUDA, where torch's varlen_attn has no enable_gqa (before 2.12), k and v
# are repeated to every head before the kernel, which saves them: the 2c(h - g) term stays. On
# CPU (block-sparse SDPA) nothing is repeated (SDPA takes grouped-query heads and saves views of
# k and v), but the chunks' outputs (saved by each chunk's SDPA) and their concatenation (o_proj's
# input) are two tensors where SDPA's one output serves both: c·h per token and saved layer
# (measured +4.4 MB = 4 layers x 1,024 tokens x 4 bytes x h=256, fp32, b=4, s=256; the packed
# rows of benchmarks/plan_vs_measured_cpu.md). The chunks' masks are made once per micro-batch,
# as additive masks in the compute dtype, and every layer's SDPA saves those same tensors (a
# bool mask would be converted, and the copy saved, in every layer): b x (sum of chunk x
# window) x c bytes, at most c·(s/2 + min(s, 2048)/2) per token (attention.chunk_plan; one
# record per row comes near it, short records far below), counted once at that bound
# (``varlen_mask_bytes``). An explicit varlen on unpacked rows runs the same way (one record per
# row): these terms count whenever the kernel is varlen, packed or not.


def _varlen_repeats_kv() -> bool:
    from .attention import VARLEN_GQA

    return not VARLEN_GQA


def packed_mask_bytes(m: ModelConfig, seq_len: int, c: int, attention: str = "sdpa",
                      device: str = "cuda") -> int:
    """Extra saved-for-backward bytes per token of one layer when sequences are packed."""
    h, g = m.hidden_size, m.num_kv_heads * (m.hidden_size // m.num_heads)
    if attention == "varlen":
        if device != "cuda":
            return c * h  # block-sparse SDPA: the chunks' outputs beside their concatenation
        return 2 * c * (h - g) if _varlen_repeats_kv() else 0
    return 2 * c * (h - g) + c * seq_len


def varlen_mask_bytes(m: ModelConfig, seq_len: int, c: int, device: str) -> int:
    """Per token, once per micro-batch: the block-sparse chunks' additive masks (varlen off
    CUDA), at their bound."""
    if m.attn_implementation != "varlen" or device == "cuda":
        return 0
    return c * (seq_len // 2 + min(seq_len, 2048) // 2 + 1)


def layer_activation_bytes(m: ModelConfig, c: int) -> int:
    """Saved-for-backward bytes per token of one decoder layer (derivation above)."""
    h, g, i = m.hidden_size, m.num_kv_heads * (m.hidden_size // m.num_heads), m.intermediate_size
    return (8 + 6 * c) * h + 2 * c * g + 4 * c * i + 4 * (m.num_heads + 2)


def saved_layer_bytes(m: ModelConfig, *, seq_len: int, c: int, packing: bool = False,
                      device: str = "cuda") -> int:
    """Saved-for-backward bytes per token of one (not checkpointed) layer, with the packed
    sequences' term when ``packing`` (that of ``m.attn_implementation`` on ``device``)."""
    varlen = m.attn_implementation == "varlen"  # its bounds are made for unpacked rows too
    extra = (packed_mask_bytes(m, seq_len, c, m.attn_implementation, device)
             if packing or varlen else 0)
    return layer_activation_bytes(m, c) + extra


def activation_bytes(m: ModelConfig, *, micro_batch: int, seq_len: int, c: int,
                     ac: Optional[CheckpointingConfig] = None, packing: bool = False,
                     device: str = "cuda") -> int:
    """Activations kept for backward by one micro-batch, loss buffers excluded (``packing``:
    data.packing, which adds the packed attention's terms above)."""
    per_layer = saved_layer_bytes(m, seq_len=seq_len, c=c, packing=packing, device=device)
    wrapped = len((ac or CheckpointingConfig()).wrapped_layers(m.num_layers))
    layers = (m.num_layers - wrapped) * per_layer + wrapped * c * m.hidden_size
    if wrapped:
        layers += per_layer  # the layer being recomputed in backward
    outside = 4 * m.hidden_size + 2 * c * m.hidden_size + 4 + 8
    outside += varlen_mask_bytes(m, seq_len, c, device)
    rope = 2 * seq_len * (m.hidden_size // m.num_heads) * c
    return micro_batch * seq_len * (layers + outside) + rope


def logits_loss_bytes(m: ModelConfig, *, micro_batch: int, seq_len: int, c: int) -> int:
    """Peak of the logits and F.cross_entropy(logits.float()) buffers, b·s·vocab wide.

    Forward: logits (c) + their fp32 copy (4, none when c is 4) + the saved fp32 log-softmax
    (4). Backward: saved log-softmax + its incoming grad + the grad to the logits (3 × 4), after
    the worker's loss function dropped its logits reference. Chunked loss would remove this.
    """
    forward = c + (4 if c < 4 else 0) + 4
    return micro_batch * seq_len * m.vocab_size * max(forward, 12)


# ---------------------------------------------------------------------------------------------
# Memory per device


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
    optimizer: int  # AdamW exp_avg + exp_avg_sq (param dtype)
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
    local = sharded_numel(param_shapes(spec.model), spec.mesh.shard)
    b = DTYPE_BYTES[spec.policy.param_dtype]
    return local * b, local * b, 2 * local * b


def _comm_bytes(spec: RunSpec) -> int:
    """Two layers in flight (current + prefetched): unsharded params (unless kept anyway) and
    grads in compute dtype, and the largest unit's unsharded params, grads and reduce-scatter
    input. Untied (parallel.py's groups) that unit is [norm, head], gathered from its forward
    to its backward (the embedding, as large, is never gathered in backward); tied, the root
    (embedding, norm, head), gathered once for forward and kept through backward, with one
    reduce-scatter input counted layer-sized (the phase model has the root's in full)."""
    m, p = spec.model, spec.policy
    c, r = DTYPE_BYTES[p.compute_dtype], DTYPE_BYTES[p.reduce_dtype]
    layer = _numel(layer_shapes(m))
    if spec.mesh.ddp:  # one gradient bucket being all-reduced
        return _ddp_bucket_bytes(spec)
    if m.tie_word_embeddings:
        largest, largest_rs = _numel(root_shapes(m)), layer
    else:
        largest = m.vocab_size * m.hidden_size + m.hidden_size
        largest_rs = max(largest, layer)
    params = 0 if not spec.mesh.reshard_after_forward else (2 * layer + largest) * c
    return params + (2 * layer + largest) * c + largest_rs * r


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


def memory_breakdown(spec: RunSpec) -> Memory:
    """Per-device memory of one training step of this spec."""
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
# step on (with optimizer state). Measured against real CPU gloo ranks in
# benchmarks/plan_vs_measured_cpu.md (66 configs: measured / max over phases 0.92 to 1.01);
# tests/multirank/test_plan_memory.py checks it on every run.

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
    optimizer params, grads, both moments and foreach AdamW's denominator (one param-size
              temporary).

    sharding=no_shard is DDP, with its own model: ``_ddp_phase_peaks``.

    Activations include the packed sequences' mask term when data.packing is true (see
    ``packed_mask_bytes``), in every phase that holds saved activations.
    """
    m, pol, t, ac, mesh = spec.model, spec.policy, spec.train, spec.checkpointing, spec.mesh
    c, r = DTYPE_BYTES[pol.compute_dtype], DTYPE_BYTES[pol.reduce_dtype]
    params, grads, optim = model_state_bytes(spec)
    if spec.sharding.cpu_offload:
        params = grads = optim = 0
    layer, root = _numel(layer_shapes(m)), _numel(root_shapes(m))
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
                                saved=saved, gloo=gloo)
    in_flight = 2 * layer * c if resharded else 0
    rs_copies = 2 if gloo else 1
    if not m.tie_word_embeddings:
        return _grouped_phase_peaks(spec, params=params, grads=grads, optim=optim, acts=acts,
                                    saved=saved, kept=kept, in_flight=in_flight,
                                    rs_copies=rs_copies)
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
        "optimizer": state + grads + params,
    }


def _grouped_phase_peaks(spec: RunSpec, *, params: int, grads: int, optim: int, acts: int,
                         saved: int, kept: int, in_flight: int, rs_copies: int) -> dict[str, int]:
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
    optimizer params, grads, both moments and foreach AdamW's temporary.

    Fitted to the 40 untied FSDP configs of benchmarks/plan_vs_measured_cpu.md: every phase
    within a few % of the measured one, the peak at 0.975-1.000 of the prediction."""
    m, pol, t, mesh = spec.model, spec.policy, spec.train, spec.mesh
    c, r = DTYPE_BYTES[pol.compute_dtype], DTYPE_BYTES[pol.reduce_dtype]
    tokens, vocab, hidden = t.batch_size * t.seq_len, m.vocab_size, m.hidden_size
    layer = _numel(layer_shapes(m))
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
        # new shard already; one shard more covers what is measured beside them (2.1 of its
        # 4.2 MB at 2 ranks fp32, 1.2 of 2.1 at 4; not identified), and with
        # accumulation the new shard is added to the old one out of place
        "root": state + grads + embed * c + rs_copies * embed * r
        + embed_shard * (2 if accumulated else 1),
        "optimizer": state + grads + params,
    }


def _grad_logits_bytes(c: int, tokens: int, vocab: int) -> int:
    """The fp32 grad of the logits, and its cast to a narrower compute dtype."""
    return (4 + (c if c < 4 else 0)) * tokens * vocab


def phase_peak_bytes(spec: RunSpec, *, gloo: bool) -> int:
    """The largest of phase_peaks: the predicted peak per rank."""
    return max(phase_peaks(spec, gloo=gloo).values())


# ---------------------------------------------------------------------------------------------
# Device


def _host_ram_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_capacity_bytes(spec: RunSpec) -> tuple[int, str]:
    """(bytes one rank may use, where that number came from)."""
    from .devices import BY_KEY, DEFAULT_GPU, local_gpu

    c = spec.cluster
    if c.device_memory_gb is not None:
        return int(c.device_memory_gb * GB), "cluster.device_memory_gb"
    if spec.device == "cuda":
        local = local_gpu() if c.kind == "local" else None
        if local is not None:
            return local[1], f"{local[0]}, torch.cuda.get_device_properties"
        key = spec.gpu or DEFAULT_GPU
        return int(BY_KEY[key].memory_gb * GB), f"{key} (cluster.gpu_type table)"
    if c.kind == "slurm" and c.mem_gb:
        return int(c.mem_gb * GB) // spec.nproc_per_node, "cluster.mem_gb / ranks per node"
    return _host_ram_bytes() // spec.nproc_per_node, "host RAM / ranks per node"


def peak_flops(spec: RunSpec) -> Optional[float]:
    """Dense peak FLOP/s of one device for the run's compute dtype: cluster.peak_tflops, else
    the accelerator table (bf16, or TF32 for fp32); None on CPU or for an unknown GPU."""
    from .devices import BY_KEY

    if spec.cluster.peak_tflops is not None:
        return spec.cluster.peak_tflops * 1e12
    if spec.device == "cuda" and spec.gpu is not None:
        return BY_KEY[spec.gpu].peak_flops(spec.policy.compute_dtype)
    return None


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
    def fits(self) -> bool:
        return self.predicted_peak_bytes <= self.usable_bytes

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
               "plan_flops_per_token": self.flops_per_token}
        if (step := self.step_time_s()) is not None:
            out[f"plan_step_time_s_at_{round(self.mfu * 100)}pct_mfu"] = step
        return out

    def table(self) -> str:
        return _table(self)


def make_plan(spec: RunSpec, *, mfu: float = DEFAULT_MFU, margin: float = DEFAULT_MARGIN) -> Plan:
    """Parameters, FLOPs per token and per-device memory of a run, against its device."""
    capacity, source = device_capacity_bytes(spec)
    return Plan(spec=spec, num_params=count_params(spec.model), n_matmul=n_matmul(spec.model),
                flops_per_token=flops_per_token(spec.model, spec.train.seq_len),
                memory=memory_breakdown(spec), capacity_bytes=capacity, capacity_source=source,
                peak_flops=peak_flops(spec), margin=margin, mfu=mfu,
                phases=phase_peaks(spec, gloo=spec.device == "cpu"))


def _rows(plan: Plan) -> list[tuple[str, int]]:
    s, mem = plan.spec, plan.memory
    p, t, ac = s.policy, s.train, s.checkpointing
    where = "sharded, offloaded to host" if s.sharding.cpu_offload else "sharded"
    ac_text = ac.mode + (f", every {ac.every_k}" if ac.mode == "selective" else "")
    return [
        (f"parameters ({where}, {p.param_dtype})", mem.params),
        (f"gradients ({where}, {p.param_dtype})", mem.grads),
        (f"optimizer (AdamW 2 moments, {p.param_dtype})", mem.optimizer),
        (f"unsharded params kept fwd->bwd ({p.compute_dtype})", mem.unsharded_params),
        ("all-gather / reduce-scatter buffers", mem.comm_buffers),
        (f"activations (b={t.batch_size}, s={t.seq_len}, AC {ac_text})", mem.activations),
        ("logits + fp32 loss (b x s x vocab)", mem.logits_loss),
    ]


def _table(plan: Plan) -> str:
    s = plan.spec
    mesh = " x ".join(f"{n}={v}" for n, v in zip(s.mesh.dim_names, s.mesh.shape))
    lines = [
        f"plan: model={s.model.name} strategy={s.strategy} ({mesh}, reshard_after_forward="
        f"{s.mesh.reshard_after_forward}) precision={s.precision.name} device={s.device} "
        f"world={s.world_size}",
        f"parameters   {plan.num_params:,} (N_matmul {plan.n_matmul:,})",
        f"FLOPs/token  {plan.flops_per_token / 1e9:.2f} GFLOP (6*N_matmul + 12*L*H*Q*T, "
        f"T={s.train.seq_len})",
        f"{'per-device memory':<52}{'GB':>10}{'GiB':>10}",
    ]
    rows = _rows(plan) + [("sum (never all live at once)", plan.memory.total)]
    lines += [f"  {name:<50}{b / GB:>10.2f}{b / GIB:>10.2f}" for name, b in rows]
    comm = "gloo" if s.device == "cpu" else "NCCL"
    lines.append(f"{'peak by phase (live at once, ' + comm + ')':<52}{'GB':>10}{'GiB':>10}")
    peak = plan.peak_phase
    lines += [f"  {name + (' <- peak' if name == peak else ''):<50}{b / GB:>10.2f}"
              f"{b / GIB:>10.2f}" for name, b in plan.phases.items()]
    rows = [(f"predicted peak (max over phases: {peak})", plan.predicted_peak_bytes),
            (f"capacity ({plan.capacity_source})", plan.capacity_bytes),
            ("headroom", plan.headroom_bytes)]
    lines += [f"  {name:<50}{b / GB:>10.2f}{b / GIB:>10.2f}" for name, b in rows]
    if plan.memory.host:
        lines.append(f"  {'host RAM per rank (cpu offload)':<50}{plan.memory.host / GB:>10.2f}"
                     f"{plan.memory.host / GIB:>10.2f}")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(f"  {verdict} with a {plan.margin:.0%} margin (usable "
                 f"{plan.usable_bytes / GB:.2f} GB)")
    if (tps := plan.tokens_per_s_per_device()) is not None:
        lines.append(f"at {plan.mfu:.0%} MFU of {plan.peak_flops / 1e12:.0f} TFLOP/s: "
                     f"{tps:,.0f} tokens/s per device, {plan.step_time_s():.3f} s per step "
                     f"({plan.tokens_per_device_step:,} tokens per device)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Variants of a spec (strategy, nodes, precision, AC, offload) and what fits


def with_strategy(spec: RunSpec, strategy: str) -> RunSpec:
    """The spec with another sharding strategy and its mesh; raise ConfigError if invalid."""
    shard_size = spec.sharding.shard_size if STRATEGIES[strategy].hybrid else None
    problems: list[str] = []
    mesh = mesh_for(strategy, shard_size, spec.world_size, spec.nproc_per_node, problems)
    if problems:
        raise ConfigError(problems)
    name = spec.run_name
    if spec.tracking.run_name is None:  # the generated name carries the strategy
        prefix = f"{spec.model.name} "
        name = name.replace(f"{prefix}{spec.strategy} ", f"{prefix}{strategy} ", 1)
    return dataclasses.replace(
        spec, strategy=strategy, mesh=mesh, run_name=name,
        sharding=dataclasses.replace(spec.sharding, strategy=strategy, shard_size=shard_size))


def with_nodes(spec: RunSpec, nodes: int) -> RunSpec:
    """The spec on another number of nodes (same ranks per node)."""
    world = nodes * spec.nproc_per_node
    problems: list[str] = []
    mesh = mesh_for(spec.strategy, spec.sharding.shard_size, world, spec.nproc_per_node, problems)
    if problems:
        raise ConfigError(problems)
    batch = spec.train.batch_size * spec.train.grad_accum * world
    return dataclasses.replace(
        spec, cluster=dataclasses.replace(spec.cluster, nodes=nodes), nodes=nodes,
        world_size=world, mesh=mesh, global_batch=batch, tokens_per_step=batch * spec.train.seq_len)


def _variants(spec: RunSpec) -> list[tuple[str, RunSpec]]:
    """Single changes that lower memory, cheapest first, as (override text, spec)."""
    out: list[tuple[str, RunSpec]] = []
    if spec.strategy != LEAST_MEMORY and spec.world_size > 1:
        out.append((f"sharding={LEAST_MEMORY}", with_strategy(spec, LEAST_MEMORY)))
    if spec.checkpointing.mode != "full":
        ck = dataclasses.replace(spec.checkpointing, mode="full")
        out.append(("checkpointing=full", dataclasses.replace(spec, checkpointing=ck)))
    if spec.train.batch_size > 1:
        t = dataclasses.replace(spec.train, batch_size=1,
                                grad_accum=spec.train.grad_accum * spec.train.batch_size)
        out.append((f"train.batch_size=1 train.grad_accum={t.grad_accum}",
                    dataclasses.replace(spec, train=t)))
    if spec.precision.name != "bf16":
        out.append(("precision=bf16 (bf16 params, grads and optimizer state)",
                    dataclasses.replace(spec, precision=PrecisionConfig(name="bf16"),
                                        policy=PRECISION_POLICIES["bf16"])))
    if spec.device == "cuda" and not spec.sharding.cpu_offload and not spec.mesh.ddp:
        sh = dataclasses.replace(spec.sharding, cpu_offload=True)
        out.append(("sharding.cpu_offload=true", dataclasses.replace(spec, sharding=sh)))
    return out


def _ddp_phase_peaks(spec: RunSpec, *, params: int, grads: int, optim: int, acts: int,
                     saved: int, gloo: bool) -> dict[str, int]:
    """phase_peaks for sharding=no_shard (DDP): the gradients live in DDP's buckets for the
    whole run (gradient_as_bucket_view), so they are part of the state in every phase; nothing
    is gathered; one bucket is all-reduced at a time (gloo copies it)."""
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
    layer = _numel(layer_shapes(m))
    return {
        "forward": state + saved + c * tokens * vocab,
        "loss": state + saved + max(
            logits_loss_bytes(m, micro_batch=t.batch_size, seq_len=t.seq_len, c=c),
            grad_logits_fp32),
        "layers": state + max(saved + c * tokens * (vocab + hidden),
                              acts + layer * c + bucket),
        "root": state + bucket,
        "optimizer": state + params,
    }


def nodes_needed(spec: RunSpec, *, max_nodes: int = 1024) -> Optional[int]:
    """Fewest nodes above spec.nodes (same ranks per node) where it fits fully sharded."""
    base = with_strategy(spec, LEAST_MEMORY)
    for nodes in range(spec.nodes + 1, max_nodes + 1):
        if make_plan(with_nodes(base, nodes)).fits:
            return nodes
    return None


def _combined(spec: RunSpec) -> tuple[str, RunSpec]:
    """Full sharding, full activation checkpointing, micro-batch 1 and bf16 together."""
    texts = [text.split(" (")[0] for text, _ in _variants(spec)
             if text != "sharding.cpu_offload=true"]
    t = dataclasses.replace(spec.train, batch_size=1,
                            grad_accum=spec.train.grad_accum * spec.train.batch_size)
    combo = dataclasses.replace(
        with_strategy(spec, LEAST_MEMORY) if spec.world_size > 1 else spec,
        checkpointing=dataclasses.replace(spec.checkpointing, mode="full"), train=t,
        precision=PrecisionConfig(name="bf16"), policy=PRECISION_POLICIES["bf16"])
    return " ".join(texts), combo


def _fixes(spec: RunSpec) -> list[str]:
    """Cheapest first: more nodes, then single config changes, then all of them together."""
    lines = []
    if spec.device == "cuda" and (n := nodes_needed(spec)) is not None:
        p = make_plan(with_nodes(with_strategy(spec, LEAST_MEMORY), n))
        lines.append(f"cluster=slurm cluster.nodes={n} sharding={LEAST_MEMORY} "
                     f"({n * spec.nproc_per_node} ranks): {p.predicted_peak_gb:.1f} GB (fits)")
    singles = [(text, make_plan(v)) for text, v in _variants(spec)]
    lines += [f"{text}: {p.predicted_peak_gb:.1f} GB" + (" (fits)" if p.fits else
                                                          " (not enough alone)")
              for text, p in singles]
    if not any(p.fits for _, p in singles):
        text, combo = _combined(spec)
        p = make_plan(combo)
        # all of them together, unless that is one change already listed (or none at all)
        if text and text not in {t.split(" (")[0] for t, _ in singles}:
            lines.append(f"{text}: {p.predicted_peak_gb:.1f} GB"
                         + (" (fits)" if p.fits else " (not enough)"))
        if not p.fits and spec.device == "cuda" and (n := nodes_needed(combo)) is not None:
            peak = make_plan(with_nodes(combo, n)).predicted_peak_gb
            lines.append(f"{text + ' ' if text else ''}cluster=slurm cluster.nodes={n} "
                         f"({n * spec.nproc_per_node} ranks): {peak:.1f} GB (fits)")
    return lines


def fixes_text(spec: RunSpec, plan: Plan) -> str:
    """Why the run does not fit, and the cheapest fixes with their predicted peaks."""
    head = (f"{spec.model.name} with sharding={spec.strategy} precision={spec.precision.name} "
            f"checkpointing={spec.checkpointing.mode} on {spec.world_size} {spec.device} rank(s) "
            f"needs {plan.predicted_peak_gb:.1f} GB per device, but {plan.usable_bytes / GB:.1f} "
            f"GB is usable ({plan.capacity_bytes / GB:.1f} GB from {plan.capacity_source}, less "
            f"a {plan.margin:.0%} margin).")
    fixes = "\n".join(f"  - {f}" for f in _fixes(spec)) or (
        "  - none left in this config: every memory-saving setting is on; it needs devices "
        "with more memory, or more of them")
    return f"{head}\nCheapest fixes (predicted peak per device):\n{fixes}"


def check_fits(spec: RunSpec, plan: Optional[Plan] = None) -> None:
    """Raise PlanError if the run cannot fit its devices (unless spec.force); log the verdict."""
    plan = plan or make_plan(spec)
    if plan.fits:
        log.info("plan: %.2f GB of %.2f GB per device fits", plan.predicted_peak_gb,
                 plan.capacity_bytes / GB)
        return
    if spec.force:
        log.warning("%s\nforce=true: launching anyway", fixes_text(spec, plan))
        return
    raise PlanError(f"{fixes_text(spec, plan)}\nOr set force=true to launch anyway.")


def _candidates(spec: RunSpec) -> list[str]:
    multi = spec.nodes > 1 or spec.sharding.shard_size is not None
    offload = spec.sharding.cpu_offload  # offload moves FSDP shards: no_shard has none
    return [s for s in AUTO_ORDER
            if (not STRATEGIES[s].hybrid or multi) and not (offload and STRATEGIES[s].ddp)]


def choose_strategy(spec: RunSpec) -> tuple[str, str]:
    """For sharding=auto: the least-communication strategy that fits, and why."""
    tried = []
    for strategy in _candidates(spec):
        try:
            plan = make_plan(with_strategy(spec, strategy))
        except ConfigError:
            continue
        if plan.fits:
            skipped = "; ".join(tried)
            return strategy, (f"{strategy}: {plan.predicted_peak_gb:.1f} GB of "
                              f"{plan.usable_bytes / GB:.1f} GB usable per device"
                              + (f" (did not fit: {skipped})" if skipped else ""))
        tried.append(f"{strategy} {plan.predicted_peak_gb:.1f} GB")
    return LEAST_MEMORY, (f"{LEAST_MEMORY}: nothing fits ({'; '.join(tried)}); {LEAST_MEMORY} "
                          "needs the least memory")


def resolve_auto(spec: RunSpec) -> RunSpec:
    """Replace sharding=auto by the chosen strategy (other specs are returned unchanged)."""
    if spec.strategy != AUTO:
        return spec
    strategy, reason = choose_strategy(spec)
    log.info("sharding=auto -> %s", reason)
    return with_strategy(spec, strategy)


# ---------------------------------------------------------------------------------------------
# What-ifs without Hydra


def reference_spec(model: str, *, nodes: int = 1, gpus_per_node: int = 8, strategy: str = "full",
                   precision: str = "bf16", ac: str = "full", batch: int = 1, seq_len: int = 2048,
                   device_memory_gb: float = 80.0) -> RunSpec:
    """A SLURM GPU RunSpec built without Hydra, for tables and what-ifs."""
    cfg = Config(model=model_preset(model), sharding=ShardingConfig(strategy=strategy),
                 precision=PrecisionConfig(name=precision),
                 checkpointing=CheckpointingConfig(mode=ac),
                 cluster=ClusterConfig(kind="slurm", nodes=nodes, gpus_per_node=gpus_per_node,
                                       time_min=60, device_memory_gb=device_memory_gb),
                 data=DataConfig(), train=TrainConfig(batch_size=batch, seq_len=seq_len),
                 output_dir="outputs/plan", resume="none")
    return build_spec(cfg, output_dir="outputs/plan")
