"""What the loss adds to a step's memory (``loss_bytes``), for each train.loss path
(llama_fsdp/objective/loss.py):

- ``full``: the head's output, b·s·vocab logits in the compute dtype, then
  ``F.cross_entropy(logits.float())``'s fp32 copies; in backward the fp32 grad of the logits.
- ``chunked``: the head and the cross-entropy chunk by chunk over the target tokens
  (train.loss_chunk of them): one chunk's logits in the compute dtype, turned in place into fp32
  softmax and gradient, then cast back; the hidden's gradient (b·s·hidden) and, where the head
  trains, its gradient (vocab·hidden, summed over the chunks in place in the compute dtype), are
  made in forward and held until backward.

objective=dpo reads the labels' log-probs per token instead (loss.token_logprobs:
``logprob_bytes``): ``full`` holds the same buffers as the summed loss; ``chunked`` saves the
hidden for a backward that recomputes each chunk's logits, so nothing of the gradients is made
in forward. Its reference's no-grad forward: ``reference_logprob_bytes``.

The phase models (full.py, lora.py, ddp.py) add these terms where they are live. Checked
against real CPU gloo ranks in benchmarks/plan_vs_measured_cpu.md (the chunked rows).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import cpu_bf16
from ..config.schema import ModelConfig, TrainConfig
from ..config.objectives import OBJECTIVES
from ..config.precision import DTYPE_BYTES
from ..run.spec import RunSpec


@dataclass(frozen=True)
class LossBytes:
    """Per-rank bytes of the loss path in each part of a step, beside the saved activations.

    ``at_head``: live when the model's forward returns; ``peak``: the loss computation's own
    high-water mark (the logits are made and freed inside it); ``head_backward``: at the
    head's backward, the gradients of its output and input (the head's own weight gradient is
    the phase models' term); ``head_grad``: a trainable head's unsharded gradient already
    made in forward (chunked), held from the loss to the head's reduce-scatter;
    ``saved_input``: the head's input, saved for its weight's gradient (full, trainable head);
    ``in_head_forward``: the loss runs inside the head's forward (chunked), where FSDP2 still
    holds the head unit's all-gather output.
    """

    at_head: int
    peak: int
    head_backward: int
    head_grad: int = 0
    saved_input: int = 0
    in_head_forward: bool = False


def logits_loss_bytes(m: ModelConfig, *, micro_batch: int, seq_len: int, c: int) -> int:
    """Peak of the logits and F.cross_entropy(logits.float()) buffers, b·s·vocab wide.

    Forward: logits (c) + their fp32 copy (4, none when c is 4) + the saved fp32 log-softmax
    (4). Backward: saved log-softmax + its incoming grad + the grad to the logits (3 × 4), after
    the worker's loss function dropped its logits reference.
    """
    forward = c + (4 if c < 4 else 0) + 4
    return micro_batch * seq_len * m.vocab_size * max(forward, 12)


def chunk_bytes(m: ModelConfig, *, tokens: int, chunk: int, c: int,
                routed: bool = False) -> int:
    """One chunk of the chunked loss at its peak: its logits in the compute dtype beside their
    fp32 copy (made in place into the softmax and the gradient; the same tensor when c is 4),
    then that gradient beside its compute-dtype cast; the chunk's rows of the hidden and its
    per-token fp32 vectors (max, sum, target logit).

    ``routed`` (bf16 products on a CPU without bf16 kernels, config/cpu_bf16.py): the
    gradient's products (gradient @ head, gradient.T @ hidden) hold fp32 copies of both
    operands and of the output beside the compute-dtype gradient: the fp32 head (vocab x
    hidden) and a chunk's rows of the hidden (measured: +8.3 MB per case against +8.65 planned,
    benchmarks/cpu_bf16_gemm.md)."""
    rows = min(chunk, tokens)
    wide = 4 + (c if c < 4 else 0)
    extra = 4 * m.hidden_size * (m.vocab_size + rows) if routed else 0
    return rows * (m.vocab_size * wide + m.hidden_size * c + 3 * 4) + 8 * tokens + extra


def routed(spec: RunSpec) -> bool:
    """Whether the run's products are fp32 GEMMs of bf16 values (model/cpu_gemm.py)."""
    return cpu_bf16.routes(spec.device, spec.policy.compute_dtype)


def loss_bytes(spec: RunSpec, *, head_trains: bool) -> LossBytes:
    """The terms of spec.train.loss for one micro-batch of this spec (objective=dpo: the
    per-token log-probs', ``logprob_bytes``)."""
    if OBJECTIVES[spec.objective.name].pairs:
        return logprob_bytes(spec, head_trains=head_trains)
    return _summed_loss_bytes(spec, head_trains=head_trains)


def _summed_loss_bytes(spec: RunSpec, *, head_trains: bool) -> LossBytes:
    m, t = spec.model, spec.train
    c = DTYPE_BYTES[spec.policy.compute_dtype]
    tokens, vocab, hidden = t.batch_size * t.seq_len, m.vocab_size, m.hidden_size
    if t.loss == TrainConfig.FULL:
        return LossBytes(at_head=c * tokens * vocab,
                         peak=logits_loss_bytes(m, micro_batch=t.batch_size, seq_len=t.seq_len,
                                                c=c),
                         head_backward=c * tokens * (vocab + hidden),
                         saved_input=c * tokens * hidden if head_trains else 0)
    grad_hidden = c * tokens * hidden
    head_grad = c * vocab * hidden if head_trains else 0
    return LossBytes(
        at_head=grad_hidden,
        # the hidden (the head's input, live through the loss), its gradient being filled,
        # one chunk (the head's gradient, summed in place, is ``head_grad``)
        peak=c * tokens * hidden + grad_hidden
        + chunk_bytes(m, tokens=tokens, chunk=t.loss_chunk, c=c, routed=routed(spec)),
        # the stored gradient of the hidden and its copy scaled and scattered to every token
        head_backward=2 * grad_hidden,
        head_grad=head_grad, in_head_forward=True)


def logprob_bytes(spec: RunSpec, *, head_trains: bool) -> LossBytes:
    """The terms of the per-token log-probs (loss.token_logprobs, DPO's policy) for one
    micro-batch. ``full``: the summed loss's buffers (F.cross_entropy without the reduction
    holds the same). ``chunked``: the hidden saved for backward, the per-token outputs and
    logsumexps (fp32), one chunk in forward; in backward the hidden's gradient, the incoming
    per-token gradient and one recomputed chunk."""
    if spec.train.loss == TrainConfig.FULL:
        return _summed_loss_bytes(spec, head_trains=head_trains)
    m, t = spec.model, spec.train
    c = DTYPE_BYTES[spec.policy.compute_dtype]
    tokens = t.batch_size * t.seq_len
    chunk = chunk_bytes(m, tokens=tokens, chunk=t.loss_chunk, c=c, routed=routed(spec))
    return LossBytes(at_head=8 * tokens, peak=chunk + 8 * tokens,
                     head_backward=c * tokens * m.hidden_size + 4 * tokens + chunk,
                     saved_input=c * tokens * m.hidden_size, in_head_forward=True)


def reference_logprob_bytes(spec: RunSpec) -> int:
    """The peak of the loss path in a no-grad forward of the per-token log-probs (DPO's
    reference): ``full``, the logits, their fp32 copy and the fp32 log-softmax; ``chunked``,
    one chunk and the per-token outputs."""
    m, t = spec.model, spec.train
    c = DTYPE_BYTES[spec.policy.compute_dtype]
    tokens = t.batch_size * t.seq_len
    if t.loss == TrainConfig.FULL:
        return tokens * m.vocab_size * (c + (4 if c < 4 else 0) + 4)
    return chunk_bytes(m, tokens=tokens, chunk=t.loss_chunk, c=c, routed=routed(spec)) + 8 * tokens
