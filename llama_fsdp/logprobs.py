"""Sequence log-probs of chosen target tokens, chunk by chunk: never b x s x vocab logits.

``sequence_logps(model, batch)`` runs the model once and returns, for every sequence of the
batch, the summed log-prob of its target tokens (data/preference.py's ``target_index`` /
``target_seq``). The model's own forward runs (so FSDP's, DDP's and autocast's hooks on the
root run as in training), with its output head answering the targets' log-probs instead of
logits: ``head_logps`` swaps the head's forward for the call. That forward is one call of the
head module, so FSDP2 gathers the head's unit once, for every chunk, and its backward (and the
reduce-scatter of its gradient) follows the one call as for logits.

``label_logps`` is the arithmetic: the hidden states of the target tokens through the head in
chunks of ``CHUNK_ELEMENTS / vocab`` tokens, each chunk's logits (compute dtype) and fp32
log-softmax alive only within it; in backward each chunk is recomputed (activation
checkpointing), so one chunk's logits are the most ever held. Only target tokens go through
the head: a prompt's positions never make logits.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# Logit elements per chunk: 2^25 (128 MiB in fp32) is 261 tokens of Llama 3's 128,256 vocabulary.
CHUNK_ELEMENTS = 1 << 25
# The batch keys the model takes (the others say where the targets are).
MODEL_KEYS = ("input_ids", "position_ids", "attention_mask")


def _chunk_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return logits.log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1)


def label_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """log p(labels[i] | hidden[i]) under the output head ``weight`` (vocab x hidden), fp32,
    for ``hidden`` [n, h] and ``labels`` [n]: chunk by chunk, recomputed in backward."""
    step = max(1, chunk_elements // weight.shape[0])
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    parts = []
    for a in range(0, hidden.shape[0], step):
        h, y = hidden[a:a + step], labels[a:a + step]
        parts.append(checkpoint(_chunk_logps, h, weight, y, use_reentrant=False) if grad
                     else _chunk_logps(h, weight, y))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


@contextlib.contextmanager
def head_logps(model: nn.Module, target_index: torch.Tensor,
               labels: torch.Tensor) -> Iterator[None]:
    """Within the block, the model's output head returns the log-probs of ``labels`` at the
    flat positions ``target_index`` of its input (b x s x h) instead of logits."""
    head = model.get_output_embeddings()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, target_index)
        return label_logps(flat, head.weight, labels)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def sequence_logps(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[number of sequences] fp32: each sequence's summed log-prob of its target tokens (a
    batch on the model's device, with data/preference.py's target keys)."""
    index, seq = batch["target_index"], batch["target_seq"]
    labels = batch["labels"].reshape(-1).index_select(0, index)
    with head_logps(model, index, labels):
        tokens = model(**{k: v for k, v in batch.items() if k in MODEL_KEYS}).logits
    n = batch["seq_records"].shape[0]
    return torch.zeros(n, dtype=torch.float32, device=tokens.device).index_add(0, seq, tokens)
