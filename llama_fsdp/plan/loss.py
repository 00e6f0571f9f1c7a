"""What the loss adds to a step's memory (``loss_bytes``), for each train.loss path
(llama_fsdp/loss.py):

- ``full``: the head's output, b·s·vocab logits in the compute dtype, then
  ``F.cross_entropy(logits.float())``'s fp32 copies; in backward the fp32 grad of the logits.
- ``chunked``: the head and the cross-entropy chunk by chunk over the target tokens
  (train.loss_chunk of them): one chunk's logits in the compute dtype, turned in place into fp32
  softmax and gradient, then cast back; the hidden's gradient (b·s·hidden) and, where the head
  trains, its gradient (vocab·hidden, summed over the chunks in place in the compute dtype), are
  made in forward and held until backward.

The phase models (full.py, lora.py, ddp.py) add these terms where they are live. Checked
against real CPU gloo ranks in benchmarks/plan_vs_measured_cpu.md (the chunked rows).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig, TrainConfig
from ..precision import DTYPE_BYTES
from ..spec import RunSpec


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


def chunk_bytes(m: ModelConfig, *, tokens: int, chunk: int, c: int) -> int:
    """One chunk of the chunked loss at its peak: its logits in the compute dtype beside their
    fp32 copy (made in place into the softmax and the gradient; the same tensor when c is 4),
    then that gradient beside its compute-dtype cast; the chunk's rows of the hidden and its
    per-token fp32 vectors (max, sum, target logit)."""
    rows = min(chunk, tokens)
    wide = 4 + (c if c < 4 else 0)
    return rows * (m.vocab_size * wide + m.hidden_size * c + 3 * 4) + 8 * tokens


def loss_bytes(spec: RunSpec, *, head_trains: bool) -> LossBytes:
    """The terms of spec.train.loss for one micro-batch of this spec."""
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
        + chunk_bytes(m, tokens=tokens, chunk=t.loss_chunk, c=c),
        # the stored gradient of the hidden and its copy scaled and scattered to every token
        head_backward=2 * grad_hidden,
        head_grad=head_grad, in_head_forward=True)
