"""The loss: next-token cross-entropy summed over the target tokens (``loss_sum``, training and
eval), and the labels' log-probabilities per token or per sequence (``token_logprobs``,
``sequence_logprobs``, and ``packed_sequence_logprobs`` for rows that hold several sequences:
DPO's pairs, llama_fsdp/objective/dpo.py, its policy and its reference), through train.loss's path:

- ``chunked`` (the default): the output projection and the cross-entropy run over the target
  tokens a chunk at a time (train.loss_chunk tokens), ignored tokens dropped before the matmul,
  so at most one chunk's logits (chunk x vocab) exist, never b x s x vocab. Inside a chunk the
  logits are made in the compute dtype and the softmax, loss and gradient in fp32. For the
  summed loss each chunk's backward runs at once (the gradients of the hidden states and of the
  head are made in forward and scaled in backward); the per-token log-probs recompute each
  chunk's logits in backward instead. Pure PyTorch: the same on CPU and GPU.
- ``full``: ``F.cross_entropy`` over all the logits, in fp32.

The chunked path runs inside the output head's own forward (``LossHead``: ``install`` gives a
model one): the model's forward is called as always, and the head, asked for a loss
(``loss_sum`` and friends set the request), returns it instead of the logits. FSDP2's hooks on
the head's unit therefore all-gather it once for all chunks, and its gradient is
reduce-scattered once; a frozen head (LoRA / QLoRA) gets no gradient at all; a tied head is
the embedding's weight, whose gradient adds to the embedding's. A micro-batch whose tokens are
all ignored still returns a loss connected to the head and the hidden states, with zero
gradients, so every rank runs the same collectives in backward.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config.schema import TrainConfig
from ..data.packing import IGNORE_INDEX
from ..model.transfer import to_device

# The batch keys a model's forward takes: a preference batch carries more (where each sequence's
# targets are, the reference's log-probs: data/preference.py), which the model must not get.
MODEL_KEYS = ("input_ids", "position_ids", "attention_mask")


def target_rows(labels: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The flat indices of the target tokens (labels not IGNORE_INDEX) on ``device``. Made
    from the host's labels before they move, so finding them costs the device no sync."""
    rows = labels.reshape(-1).ne(IGNORE_INDEX).nonzero().squeeze(1)
    return to_device(rows, device)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor as the whole tensor it stands for (replicated: its local copy; sharded:
    gathered, differentiably); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    return t.to_local() if all(p.is_replicate() for p in t.placements) else t.full_tensor()


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's where it is on (DDP's precision=mixed),
    else the weight's (FSDP2 has cast it already)."""
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return weight.dtype


def _chunk_grad(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor,
                scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of rows ``h``: (their summed NLL in fp32, and the gradient of ``scale`` times it
    with respect to their logits, in the compute dtype: softmax minus one-hot). The logits are
    made in the compute dtype and turned into fp32 at once, and everything after that is done
    in place: at most the logits in the compute dtype and in fp32 exist together."""
    logits = (h @ w.T).float()
    logits -= logits.amax(1, keepdim=True)
    target = logits.gather(1, targets[:, None]).squeeze(1)
    logits.exp_()
    total = logits.sum(1)
    nll = (total.log() - target).sum()
    logits /= total[:, None]
    logits.scatter_add_(1, targets[:, None], logits.new_full((len(targets), 1), -1.0))
    if scale is not None:
        logits.mul_(scale)
    return nll, logits.to(h.dtype)


def _chunk_step(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor,
                scale: Optional[torch.Tensor], grad_h: Optional[torch.Tensor],
                grad_w: Optional[torch.Tensor], need_w: bool) -> tuple[torch.Tensor,
                                                                     Optional[torch.Tensor]]:
    """One chunk's NLL, and its backward at once: its rows of the hidden's gradient written into
    ``grad_h`` (a view), the head's gradient added to ``grad_w`` (None: this chunk's starts
    it). Returns (the NLL, the head's gradient so far); the chunk's temporaries end here."""
    if grad_h is None and not need_w:  # eval: the loss alone
        logits = (h @ w.T).float()
        return (torch.logsumexp(logits, 1) - logits.gather(1, targets[:, None])[:, 0]).sum(), None
    nll, g = _chunk_grad(h, w, targets, scale)
    if grad_h is not None:
        torch.mm(g, w, out=grad_h)
    if need_w:
        grad_w = g.T @ h if grad_w is None else grad_w.addmm_(g.T, h)
    return nll, grad_w


def _chunk_logprobs(h: torch.Tensor, w: torch.Tensor,
                    targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of rows ``h`` -> (the targets' fp32 log-probs, each row's logsumexp)."""
    logits = (h @ w.T).float()
    lse = torch.logsumexp(logits, 1)
    return logits.gather(1, targets[:, None]).squeeze(1) - lse, lse


class _ChunkedCrossEntropy(torch.autograd.Function):
    """sum over ``rows`` of -log softmax(hidden @ weight.T)[label], chunk by chunk; the
    gradients are made in forward, one chunk at a time, and scaled in backward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                rows: torch.Tensor, chunk: int, grad: bool,
                scale: Optional[torch.Tensor]) -> torch.Tensor:
        cd = _compute_dtype(hidden, weight)
        need_h, need_w = grad and ctx.needs_input_grad[0], grad and ctx.needs_input_grad[1]
        w = weight.to(cd)
        all_rows = len(rows) == len(hidden)
        grad_h = hidden.new_empty((len(rows), hidden.shape[1]), dtype=cd) if need_h else None
        grad_w = None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, len(rows), chunk):
                end = min(start + chunk, len(rows))
                idx = rows[start:end]
                h = (hidden[start:end] if all_rows else hidden.index_select(0, idx)).to(cd)
                nll, grad_w = _chunk_step(h, w, labels.index_select(0, idx), scale,
                                          grad_h[start:end] if need_h else None, grad_w, need_w)
                loss += nll
        if need_w and grad_w is None:  # no target token here: a zero gradient all the same
            grad_w = torch.zeros_like(w)
        ctx.grads, ctx.scale = (grad_h, grad_w), scale
        ctx.rows, ctx.all_rows, ctx.hidden_meta = rows, all_rows, (hidden.shape, hidden.dtype)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, out: torch.Tensor):
        (grad_h, grad_w), ctx.grads = ctx.grads, (None, None)
        # the gradients were made for loss * scale: a factor of exactly 1 when the caller's is
        # the scale it announced (train_step's), so no rounding is added here
        factor = out if ctx.scale is None else out / ctx.scale
        grad_hidden = grad_weight = None
        if grad_h is not None:
            shape, dtype = ctx.hidden_meta
            grad_h = grad_h.mul_(factor.to(grad_h.dtype)).to(dtype)
            grad_hidden = grad_h if ctx.all_rows else grad_h.new_zeros(shape).index_copy_(
                0, ctx.rows, grad_h)
        if grad_w is not None:
            grad_weight = grad_w.mul_(factor.to(grad_w.dtype)).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def _logprob_grad(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                  upstream: torch.Tensor) -> torch.Tensor:
    """The gradient of sum(upstream * log p[target]) with respect to one chunk's logits, in the
    compute dtype: (onehot - softmax) * upstream, from the recomputed logits in fp32."""
    p = (h @ w.T).float().sub_(lse[:, None]).exp_()
    p.scatter_add_(1, targets[:, None], p.new_full((len(targets), 1), -1.0))
    return p.mul_(-upstream[:, None]).to(h.dtype)


class _ChunkedLogProbs(torch.autograd.Function):
    """log softmax(hidden @ weight.T)[label] of every row (0 where ignored), chunk by chunk;
    backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                rows: torch.Tensor, chunk: int, shape: tuple[int, ...]) -> torch.Tensor:
        cd = _compute_dtype(hidden, weight)
        w = weight.to(cd)
        # allocated in the labels' shape and returned whole: a view returned from the head's
        # forward is what FSDP2 warns about (its pre-backward hook sits on the module's output)
        out = torch.zeros(shape, dtype=torch.float32, device=hidden.device)
        flat = out.view(-1)
        lse = torch.empty(len(rows), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, len(rows), chunk):
                idx = rows[start:start + chunk]
                lp, lse[start:start + chunk] = _chunk_logprobs(
                    hidden.index_select(0, idx).to(cd), w, labels.index_select(0, idx))
                flat.index_copy_(0, idx, lp)
        ctx.save_for_backward(hidden, weight, labels, rows, lse)
        ctx.chunk, ctx.cd = chunk, cd
        return out

    @staticmethod
    def backward(ctx, out: torch.Tensor):
        out = out.reshape(-1)
        hidden, weight, labels, rows, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        cd, w = ctx.cd, weight.to(ctx.cd)
        grad_h = torch.zeros(hidden.shape, dtype=cd, device=hidden.device) if need_h else None
        grad_w = torch.zeros_like(w) if need_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, len(rows), ctx.chunk):
                idx = rows[start:start + ctx.chunk]
                h = hidden.index_select(0, idx).to(cd)
                g = _logprob_grad(h, w, labels.index_select(0, idx),
                                  lse[start:start + ctx.chunk], out.index_select(0, idx))
                if need_h:
                    grad_h.index_copy_(0, idx, g @ w)
                if need_w:
                    grad_w.addmm_(g.T, h)
                del g  # before the next chunk's logits
        return (grad_h.to(hidden.dtype) if need_h else None,
                grad_w.to(weight.dtype) if need_w else None, None, None, None, None)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          chunk: int, rows: Optional[torch.Tensor] = None,
                          grad_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """sum over target tokens of -log softmax(hidden @ weight.T)[label], in fp32, never more
    than ``chunk`` tokens' logits at once. ``hidden`` (..., H) and ``labels`` (...) flat or
    not; ``rows``: the target tokens' flat indices (``target_rows``), found here if not
    given; ``grad_scale``: the factor the caller multiplies the loss by before backward (a 0-d
    tensor), applied to each chunk's fp32 gradient before its cast to the compute dtype, as
    autograd applies it over the full logits (any other factor still gives right
    gradients)."""
    hidden, weight = _plain(hidden), _plain(weight)
    labels = labels.reshape(-1)
    rows = target_rows(labels, labels.device) if rows is None else rows
    return _ChunkedCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels,
                                      rows, chunk, torch.is_grad_enabled(), grad_scale)


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                           chunk: int, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """log softmax(hidden @ weight.T)[label] per token in fp32, shaped as ``labels``, 0 where a
    label is IGNORE_INDEX; never more than ``chunk`` tokens' logits at once."""
    hidden, weight = _plain(hidden), _plain(weight)
    flat = labels.reshape(-1)
    rows = target_rows(flat, flat.device) if rows is None else rows
    return _ChunkedLogProbs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, flat, rows, chunk,
                                  tuple(labels.shape))


# ---------------------------------------------------------------------------------------------
# The model's head computes the loss inside its own forward


@dataclass
class _Request:
    labels: torch.Tensor
    rows: torch.Tensor
    per_token: bool
    grad_scale: Optional[torch.Tensor] = None


class LossHead(nn.Linear):
    """The output head of a model that train.loss=chunked runs (``install``): an nn.Linear
    whose forward, while a loss is requested (``request``), takes the hidden states and returns
    the summed cross-entropy (or the per-token log-probs) of the requested labels through the
    chunked path, instead of the logits. Without a request it is the plain head (generation)."""

    chunk: int = TrainConfig.loss_chunk
    _request: Optional[_Request] = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        r = self._request
        if r is None:
            return super().forward(hidden)
        if r.per_token:
            return chunked_token_logprobs(hidden, self.weight, r.labels, chunk=self.chunk,
                                          rows=r.rows)
        return chunked_cross_entropy(hidden, self.weight, r.labels, chunk=self.chunk,
                                     rows=r.rows, grad_scale=r.grad_scale)

    @contextlib.contextmanager
    def request(self, labels: torch.Tensor, rows: torch.Tensor, *, per_token: bool,
                grad_scale: Optional[torch.Tensor] = None) -> Iterator[None]:
        """Within: this head's forward returns the loss of ``labels`` (one model forward)."""
        self._request = _Request(labels, rows, per_token, grad_scale)
        try:
            yield
        finally:
            self._request = None


def install(model: nn.Module, *, chunk: int) -> None:
    """Make the model's output head a LossHead of ``chunk`` tokens (before it is sharded: the
    FSDP2 class built for it then keeps the loss-aware forward)."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(f"train.loss=chunked needs an nn.Linear output head, not {type(head)}")
    head.__class__ = LossHead
    head.chunk = chunk


def _head(model: nn.Module) -> Optional[LossHead]:
    head = model.get_output_embeddings()
    return head if isinstance(head, LossHead) else None


def _split(batch: dict[str, torch.Tensor],
           rows: Optional[torch.Tensor]) -> tuple[dict, torch.Tensor, torch.Tensor]:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    labels = batch["labels"]
    return inputs, labels, target_rows(labels, labels.device) if rows is None else rows


def loss_sum(model: nn.Module, batch: dict[str, torch.Tensor], *,
             rows: Optional[torch.Tensor] = None,
             grad_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Summed next-token cross-entropy over the batch's target tokens (fp32), by the model's
    loss path. ``rows``: the target tokens' flat indices on the batch's device, if known
    (``target_rows`` of the host's labels: no sync); ``grad_scale``: what the caller will
    multiply the loss by before backward (chunked_cross_entropy says why)."""
    head = _head(model)
    if head is None:  # train.loss=full
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs).logits
        return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    inputs, labels, rows = _split(batch, rows)
    with head.request(labels, rows, per_token=False, grad_scale=grad_scale):
        return model(**inputs).logits


def token_logprobs(model: nn.Module, batch: dict[str, torch.Tensor], *,
                   rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """log p(label | prefix) of every token (fp32, shaped as the labels, 0 where ignored), by
    the model's loss path."""
    head = _head(model)
    if head is None:  # train.loss=full
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs).logits.float()
        labels = batch["labels"]
        lp = -F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none",
                              ignore_index=IGNORE_INDEX)
        return lp.view(labels.shape)
    inputs, labels, rows = _split(batch, rows)
    with head.request(labels, rows, per_token=True):
        return model(**inputs).logits


def sequence_logprobs(model: nn.Module, batch: dict[str, torch.Tensor], *,
                      rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each row's summed log-probability of its target tokens (fp32, one per row): the
    sequence log-probs DPO compares (rows are whole sequences, not packed)."""
    return token_logprobs(model, batch, rows=rows).sum(-1)


def packed_sequence_logprobs(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[sequences] fp32: each sequence's summed log-prob of its target tokens, for a batch whose
    rows hold several sequences (data/preference.py's PairPacked: ``target_index``, the target
    tokens' flat positions; ``target_seq``, the sequence of each; ``seq_records``, one per
    sequence), by the model's loss path: with train.loss=chunked only the target tokens reach
    the head, a chunk at a time."""
    rows, seq = batch["target_index"], batch["target_seq"]
    inputs = {k: v for k, v in batch.items() if k in (*MODEL_KEYS, "labels")}
    tokens = token_logprobs(model, inputs, rows=rows).reshape(-1).index_select(0, rows)
    return tokens.new_zeros(batch["seq_records"].shape[0]).index_add(0, seq, tokens)
