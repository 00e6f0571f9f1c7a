"""Activation memory of a training step: what autograd saves for backward, per token and
layer, derived for transformers' Llama (SwiGLU, RMSNorm, fused attention) and checked against
the bytes autograd really saves (tests/unit/test_plan.py) and against real ranks
(benchmarks/plan_vs_measured_cpu.md)."""
from __future__ import annotations

from typing import Optional

from ..config.kernels import SDPA, VARLEN
from ..config.schema import CheckpointingConfig, ModelConfig


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
# (Korthikanti's GPT layer: 34h + 5·heads·s). Outside the layers: the final RMSNorm (4h + c·h
# + 4; its weighted output is the head's input, saved or not by the loss: plan/loss.py),
# int64 input ids kept by the embedding (8) and RoPE cos/sin (2·s·Q·c per sequence).
# tests/unit/test_plan.py checks all of this against the bytes autograd really saves.
# Full activation checkpointing keeps only each layer's input (c·h); layer-selective wraps
# every k-th layer (floor(L/k) layers, as model/parallelize.py). Backward recomputes one wrapped layer
# at a time, so one layer's full activations are added back while any layer is wrapped.
# checkpointing.offload (llama_fsdp/model/offload.py) keeps those inputs in pinned host memory on
# CUDA: on the device stay the input being recomputed and the next one, brought back ahead.


# Packed sequences (data.packing=true): position_ids restart at every document, so transformers
# builds a 4-D block-diagonal causal mask (b x 1 x s x s) instead of passing none. With a mask,
# SDPA no longer takes the GQA fast path: transformers repeats k and v to all heads, and SDPA
# keeps a compute-dtype copy of the b x s x s mask; both are saved for backward per layer:
#   k, v repeated from g to h wide                                      -> 2c·(h - g)
#   the mask in compute dtype, one row of s per token                   -> c·s
# per token and saved layer, i.e. layers x b x s x (2c(h - g) + c·s) bytes (measured on CPU
# gloo ranks: benchmarks/plan_vs_measured_cpu.md). It counts where
# the layer's other activations count: not for a checkpointed layer (which keeps its input
# only), once more for the layer recomputed in backward. The s term makes it quadratic in the
# sequence: at s=8192 it is GBs over a layer stack.


# model.attn_implementation=varlen (llama_fsdp/model/attention.py) takes packed rows with no b x s x s
# mask: no c·s term. On CUDA, where torch's varlen_attn has no enable_gqa (before 2.12), k and v
# are repeated to every head before the kernel, which saves them: the 2c(h - g) term stays. On
# CPU (block-sparse SDPA) nothing is repeated (SDPA takes grouped-query heads and saves views of
# k and v), but the chunks' outputs (saved by each chunk's SDPA) and their concatenation (o_proj's
# input) are two tensors where SDPA's one output serves both: c·h per token and saved layer
# (the packed rows of benchmarks/plan_vs_measured_cpu.md). The chunks' masks are made once per micro-batch,
# as additive masks in the compute dtype, and every layer's SDPA saves those same tensors (a
# bool mask would be converted, and the copy saved, in every layer): b x (sum of chunk x
# window) x c bytes, at most c·(s/2 + min(s, 2048)/2) per token (attention.chunk_plan; one
# record per row comes near it, short records far below), counted once at that bound
# (``varlen_mask_bytes``). An explicit varlen on unpacked rows runs the same way (one record per
# row): these terms count whenever the kernel is varlen, packed or not.


# checkpointed inputs on the device with checkpointing.offload: the one being recomputed and
# the one being brought back for the layer before it
OFFLOAD_IN_FLIGHT = 2


def checkpointed_inputs(ac: CheckpointingConfig, num_layers: int, device: str) -> tuple[int, int]:
    """(on the device, in host memory): how many checkpointed layers' inputs are kept where
    between forward and backward (with offload, every one has its pinned host copy: blocks
    the caching host allocator keeps for the next step)."""
    wrapped = len(ac.wrapped_layers(num_layers))
    if ac.offload and device == "cuda":
        return min(wrapped, OFFLOAD_IN_FLIGHT), wrapped
    return wrapped, 0


def _varlen_repeats_kv() -> bool:
    from ..versions import varlen_takes_gqa

    return not varlen_takes_gqa()


def packed_mask_bytes(m: ModelConfig, seq_len: int, c: int, attention: str = SDPA,
                      device: str = "cuda") -> int:
    """Extra saved-for-backward bytes per token of one layer when sequences are packed."""
    h, g = m.hidden_size, m.num_kv_heads * (m.hidden_size // m.num_heads)
    if attention == VARLEN:
        if device != "cuda":
            return c * h  # block-sparse SDPA: the chunks' outputs beside their concatenation
        return 2 * c * (h - g) if _varlen_repeats_kv() else 0
    return 2 * c * (h - g) + c * seq_len


def varlen_mask_bytes(m: ModelConfig, seq_len: int, c: int, device: str) -> int:
    """Per token, once per micro-batch: the block-sparse chunks' additive masks (varlen off
    CUDA), at their bound."""
    if m.attn_implementation != VARLEN or device == "cuda":
        return 0
    return c * (seq_len // 2 + min(seq_len, 2048) // 2 + 1)


# The flash varlen backward's fp32 dq accumulator (flash-attention 2's mha_varlen_bwd, which
# torch's varlen_attn runs): (tokens + 128 x sequences) x heads x head_dim (rounded up to 32)
# x 4 bytes, for the micro-batch's sequences (its records: every record is one), live through
# one layer's attention backward. By then that layer's backward has freed what only its MLP
# and output projection needed (backward runs the layer in reverse): the MLP's four
# intermediates (4·c·i per token of layer_activation_bytes), the post-attention norm's fp32
# input and normed output (4·h + c·h) and the attention output o_proj read (c·h), so the
# layers' backward peak grows by the workspace less those (``varlen_backward_extra``).
# Measured on an H200 (benchmarks/gpu.md): 8B QLoRA at 16,384 tokens of 2,397 synthetic
# records (one row) allocated 5.2953 GB there in one tensor, the formula's 5.2953 GB; the peak,
# 17.28 GB, was 24% over the plan without this term. Data-dependent: the plan counts one
# record per row until the data is known (prepare.replan_for_records gives the fullest
# micro-batch's count).
VARLEN_BWD_PAD = 128


def flash_varlen_runs(m: ModelConfig, device: str) -> bool:
    """Whether attention is torch's flash varlen_attn (model.attn_implementation=varlen on
    CUDA; off CUDA varlen is the block-sparse SDPA)."""
    return m.attn_implementation == VARLEN and device == "cuda"


def varlen_backward_bytes(m: ModelConfig, *, micro_batch: int, seq_len: int, device: str,
                          records: Optional[int] = None) -> int:
    """The flash varlen backward's workspace (above) for a micro-batch of ``records``
    sequences (None: one per row); 0 where flash varlen does not run."""
    if not flash_varlen_runs(m, device):
        return 0
    d = m.hidden_size // m.num_heads
    rounded = -(-d // 32) * 32
    seqs = micro_batch if records is None else max(records, micro_batch)
    return (micro_batch * seq_len + VARLEN_BWD_PAD * seqs) * m.num_heads * rounded * 4


def varlen_backward_extra(m: ModelConfig, *, micro_batch: int, seq_len: int, c: int,
                          device: str, records: Optional[int] = None) -> int:
    """What the flash varlen workspace adds to the layers' backward peak: the workspace less
    what its layer has freed by its attention backward (above)."""
    workspace = varlen_backward_bytes(m, micro_batch=micro_batch, seq_len=seq_len,
                                      device=device, records=records)
    freed = ((4 * m.intermediate_size + 2 * m.hidden_size) * c + 4 * m.hidden_size) \
        * micro_batch * seq_len
    return max(0, workspace - freed)


def layer_activation_bytes(m: ModelConfig, c: int) -> int:
    """Saved-for-backward bytes per token of one decoder layer (derivation above)."""
    h, g, i = m.hidden_size, m.num_kv_heads * (m.hidden_size // m.num_heads), m.intermediate_size
    return (8 + 6 * c) * h + 2 * c * g + 4 * c * i + 4 * (m.num_heads + 2)


def saved_layer_bytes(m: ModelConfig, *, seq_len: int, c: int, packing: bool = False,
                      device: str = "cuda") -> int:
    """Saved-for-backward bytes per token of one (not checkpointed) layer, with the packed
    sequences' term when ``packing`` (that of ``m.attn_implementation`` on ``device``)."""
    varlen = m.attn_implementation == VARLEN  # its bounds are made for unpacked rows too
    extra = (packed_mask_bytes(m, seq_len, c, m.attn_implementation, device)
             if packing or varlen else 0)
    return layer_activation_bytes(m, c) + extra


def activation_bytes(m: ModelConfig, *, micro_batch: int, seq_len: int, c: int,
                     ac: Optional[CheckpointingConfig] = None, packing: bool = False,
                     device: str = "cuda") -> int:
    """Activations kept for backward by one micro-batch, the loss's excluded (``packing``:
    data.packing, which adds the packed attention's terms above)."""
    per_layer = saved_layer_bytes(m, seq_len=seq_len, c=c, packing=packing, device=device)
    ac = ac or CheckpointingConfig()
    wrapped = len(ac.wrapped_layers(m.num_layers))
    on_device, _ = checkpointed_inputs(ac, m.num_layers, device)
    layers = (m.num_layers - wrapped) * per_layer + on_device * c * m.hidden_size
    if wrapped:
        layers += per_layer  # the layer being recomputed in backward
    outside = 4 * m.hidden_size + c * m.hidden_size + 4 + 8
    outside += varlen_mask_bytes(m, seq_len, c, device)
    rope = 2 * seq_len * (m.hidden_size // m.num_heads) * c
    return micro_batch * seq_len * (layers + outside) + rope
