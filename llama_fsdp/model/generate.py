"""Decoding from a (possibly sharded) model: batched, left-padded, with a KV cache."""
from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch
from torch import nn

from .attention import standard_attention


def cache_kwarg() -> str:
    """The keyword LlamaForCausalLM takes its KV cache by: ``cache`` from transformers 5.24 on
    (``past_key_values`` is deprecated there and warns on every rank), ``past_key_values``
    before."""
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters \
        else "past_key_values"


def all_ended(done: torch.Tensor) -> bool:
    """Whether every prompt on every rank has ended: one all-reduce (of this rank's unfinished
    count), so that the ranks stop decoding at the same token and stay in lockstep."""
    import torch.distributed as dist

    left = (~done).sum().to(torch.int64).reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(left)
    return int(left.item()) == 0


def greedy_generate(model: nn.Module, prompts: list[np.ndarray], tok: Any, *,
                    device: torch.device, steps: int, until_all_done: bool = False) -> list[str]:
    """Left-padded batched greedy decoding with a KV cache: one forward over the prompts, then
    one per new token, for ``steps`` tokens at most. With ``until_all_done`` (collective) it
    stops when every prompt on every rank has ended (``all_ended``), so ranks stay in lockstep
    under FSDP; without, it runs all ``steps``."""
    from transformers import DynamicCache

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
        if until_all_done and all_ended(done):
            break
        ids, pos = nxt[:, None], pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones_like(nxt)[:, None]], 1)
    out = []
    for row in torch.stack(new, 1).cpu().tolist():
        if tok.eos_token_id in row:
            row = row[:row.index(tok.eos_token_id)]
        out.append(tok.decode(row, skip_special_tokens=True).strip())
    return out
