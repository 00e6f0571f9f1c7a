"""objective=sft: next-token cross-entropy on the answers, and its held-out evaluation (the
token-mean eval loss, and greedy answers scored by exact match).

The loss is summed over a micro-batch's target tokens (loss.loss_sum) and divided by the step's
global target count (train/loop.py), so N ranks compute exactly the 1-rank gradient. The
evaluation is collective under FSDP: every rank runs the same number of forward calls (ranks
with fewer batches or prompts run stand-ins that are not counted), and the counts are summed
across ranks, so the numbers are the same on every rank and independent of the world size.
"""
from __future__ import annotations

import math
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..config import metrics as m
from ..config.schema import EvalConfig
from ..data.packing import IGNORE_INDEX
from ..model.attention import model_inputs
from ..model.generate import greedy_generate
from .loss import loss_sum, target_rows


class TokenLoss:
    """SFT's loss for ``train_step``: summed over a micro-batch's target tokens (loss.loss_sum,
    by train.loss's path); the step divides by the global target count (``count`` summed over
    micro-batches and ranks). Another objective gives the same two methods (dpo.PreferenceLoss:
    pairs), and metrics of its own: sums normalized and reduced like the loss. ``rows``: the
    target tokens' flat indices on the device; ``grad_scale``: what the step multiplies the sum
    by before backward (loss.chunked_cross_entropy says why it helps)."""

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor], *, rows: torch.Tensor,
                 grad_scale: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return loss_sum(model, batch, rows=rows, grad_scale=grad_scale), {}


TOKEN_LOSS = TokenLoss()


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return t


@torch.no_grad()
def eval_loss(model: nn.Module, batches: list[dict[str, torch.Tensor]], *,
              device: torch.device) -> float:
    """Token-mean loss over every rank's held-out batches."""
    n = int(_all_reduce(torch.tensor(len(batches), device=device), dist.ReduceOp.MIN).item())
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, device=device, dtype=torch.float64)
    try:
        for batch in batches[:n]:  # every rank runs the same number of forwards (FSDP)
            rows = target_rows(batch["labels"], device)
            batch = model_inputs(model, batch, device)
            sums[0] += loss_sum(model, batch, rows=rows).double()
            sums[1] += len(rows)
    finally:
        model.train(was_training)
    s, c = _all_reduce(sums).tolist()
    return s / max(c, 1.0)


def task_prompts(store: Any, tok: Any, max_prompts: Optional[int],
                 max_answer_tokens: Optional[int] = None
                 ) -> list[tuple[np.ndarray, str, str, int]]:
    """(prompt ids, reference answer, task kind, answer tokens) of held-out records with an
    intact answer of at most ``max_answer_tokens`` tokens (with its EOS), in split order."""
    out = []
    for i in range(len(store)):
        if max_prompts is not None and len(out) >= max_prompts:
            break
        p = int(store.prompt_len[i])
        if p <= 0 or store.truncated[i]:
            continue
        x, _ = store.record(i)
        if max_answer_tokens is not None and len(x) - p > max_answer_tokens:
            continue
        answer = tok.decode(x[p:].tolist(), skip_special_tokens=True).strip()
        out.append((x[:p], answer, store.task(i) or "all", len(x) - p))
    return out


@torch.no_grad()
def exact_match(model: nn.Module, data: Any, *, device: torch.device,
                max_prompts: Optional[int] = 64, max_new_tokens: Optional[int] = None,
                batch_size: Optional[int] = None) -> dict[str, float]:
    """Greedy answers to held-out prompts with short answers, scored by exact match, overall and
    per task kind.

    ``data`` is the rank's DataModule (its eval split, tokenizer, rank and world). Only answers
    of at most ``max_new_tokens`` tokens (EvalConfig.SHORT_ANSWER_TOKENS when None) are scored,
    and decoding stops when every prompt on every rank has ended. {} when the eval split has no
    such prompt/answer record (plain text, long answers).
    """
    tok = data.tokenizer
    bound = max_new_tokens or EvalConfig.SHORT_ANSWER_TOKENS
    prompts = task_prompts(data.eval.store, tok, max_prompts, bound)
    if not prompts:
        return {}
    steps = max_new_tokens or max(p[3] for p in prompts)  # the longest answer, with its EOS
    batch_size = batch_size or data.micro_batch
    kinds = sorted({p[2] for p in prompts})
    per_rank = math.ceil(len(prompts) / data.dp_world)
    mine = list(range(data.dp_rank * per_rank, (data.dp_rank + 1) * per_rank))
    counts = torch.zeros(2, len(kinds), dtype=torch.float64)  # [correct, total] per kind
    was_training = model.training
    model.eval()
    try:
        for i in range(0, per_rank, batch_size):
            chunk = mine[i:i + batch_size]
            # ranks past the end answer a stand-in prompt, uncounted, to keep forward calls equal
            batch = [prompts[j if j < len(prompts) else 0][0] for j in chunk]
            answers = greedy_generate(model, batch, tok, device=device, steps=steps,
                                      until_all_done=True)
            for j, ans in zip(chunk, answers):
                if j < len(prompts):
                    k = kinds.index(prompts[j][2])
                    counts[0, k] += float(ans == prompts[j][1])
                    counts[1, k] += 1
    finally:
        model.train(was_training)
    counts = _all_reduce(counts.to(device)).cpu()
    out = {m.EXACT_MATCH: float(counts[0].sum() / counts[1].sum())}
    if len(kinds) > 1:
        out.update({f"{m.EXACT_MATCH}/{k}": float(counts[0, i] / counts[1, i])
                    for i, k in enumerate(kinds) if counts[1, i] > 0})
    return out


class SFT:
    """objective=sft for a rank's run (objective/__init__.py's interface): the token loss, the
    data's rows as they are, and the held-out eval loss and exact match."""

    loss = TOKEN_LOSS

    def __init__(self, device: torch.device):
        self.device = device

    def batches(self, it: Iterator[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        return it

    def evaluate(self, model: nn.Module, data: Any, ev: EvalConfig) -> dict[str, float]:
        """Eval loss on the held-out batches, and exact match of greedy answers (collective)."""
        out = {m.EVAL_LOSS: eval_loss(model, data.eval_batches(ev.max_batches),
                                      device=self.device)}
        if ev.task_prompts:
            # Generation grows the sequence one token at a time: eager, not recompiled per
            # length.
            with torch.compiler.set_stance("force_eager"):
                scores = exact_match(model, data, device=self.device, max_prompts=ev.task_prompts,
                                     max_new_tokens=ev.max_new_tokens)
            out.update({m.EVAL_PREFIX + k: v for k, v in scores.items()})
        return out

    def summary(self, logged: list[dict[str, float]], final: dict[str, float]
                ) -> dict[str, float]:
        return {}


def build(spec: Any, model: nn.Module, data: Any, device: torch.device, **_: Any) -> SFT:
    return SFT(device)
