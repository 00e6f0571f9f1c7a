"""Held-out evaluation: token-mean eval loss, and greedy answers scored by exact match.

Both are collective under FSDP: every rank runs the same number of forward calls (ranks with
fewer batches or prompts run stand-ins that are not counted), and the counts are summed across
ranks, so the numbers are the same on every rank and independent of the world size.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..model.attention import model_inputs, standard_attention
from .loss import loss_sum, target_rows


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


def task_prompts(store: Any, tok: Any,
                 max_prompts: Optional[int]) -> list[tuple[np.ndarray, str, str, int]]:
    """(prompt ids, reference answer, task kind, answer tokens) of held-out records with an
    intact answer, in split order."""
    out = []
    for i in range(len(store)):
        if max_prompts is not None and len(out) >= max_prompts:
            break
        p = int(store.prompt_len[i])
        if p <= 0 or store.truncated[i]:
            continue
        x, _ = store.record(i)
        answer = tok.decode(x[p:].tolist(), skip_special_tokens=True).strip()
        out.append((x[:p], answer, store.task(i) or "all", len(x) - p))
    return out


@torch.no_grad()
def exact_match(model: nn.Module, data: Any, *, device: torch.device,
                max_prompts: Optional[int] = 64, max_new_tokens: Optional[int] = None,
                batch_size: Optional[int] = None) -> dict[str, float]:
    """Greedy answers to held-out prompts scored by exact match, overall and per task kind.

    ``data`` is the rank's DataModule (its eval split, tokenizer, rank and world). {} when the
    eval split has no prompt/answer records (plain text).
    """
    tok = data.tokenizer
    prompts = task_prompts(data.eval.store, tok, max_prompts)
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
            answers = greedy_generate(model, batch, tok, device=device, steps=steps)
            for j, ans in zip(chunk, answers):
                if j < len(prompts):
                    k = kinds.index(prompts[j][2])
                    counts[0, k] += float(ans == prompts[j][1])
                    counts[1, k] += 1
    finally:
        model.train(was_training)
    counts = _all_reduce(counts.to(device)).cpu()
    out = {"exact_match": float(counts[0].sum() / counts[1].sum())}
    if len(kinds) > 1:
        out.update({f"exact_match/{k}": float(counts[0, i] / counts[1, i])
                    for i, k in enumerate(kinds) if counts[1, i] > 0})
    return out


def greedy_generate(model: nn.Module, prompts: list[np.ndarray], tok: Any, *,
                    device: torch.device, steps: int) -> list[str]:
    """Left-padded batched greedy decoding with a KV cache, for exactly ``steps`` forward calls
    (one over the prompts, then one per new token), so ranks stay in lockstep under FSDP."""
    from transformers import DynamicCache

    from ..versions import cache_kwarg

    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.from_numpy(p.astype(np.int64))
        mask[i, longest - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = {cache_kwarg(): DynamicCache()}
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    new = []
    for _ in range(steps):
        with standard_attention(model):  # a padding mask and a KV cache: not varlen's inputs
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache,
                           use_cache=True, logits_to_keep=1).logits[:, -1]
        nxt = logits.argmax(-1).masked_fill(done, tok.pad_token_id)
        done |= nxt == tok.eos_token_id
        new.append(nxt)
        ids, pos = nxt[:, None], pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones_like(nxt)[:, None]], 1)
    out = []
    for row in torch.stack(new, 1).cpu().tolist():
        if tok.eos_token_id in row:
            row = row[:row.index(tok.eos_token_id)]
        out.append(tok.decode(row, skip_special_tokens=True).strip())
    return out
