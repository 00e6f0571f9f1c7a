"""Data: per-rank micro-batches for training and evaluation.

PLACEHOLDER synthetic source until the data path (issue 3) lands; the interface is what the
worker relies on:

- ``build_data(cfg, *, seq_len, micro_batch, dp_rank, dp_world, seed, cache_dir, vocab_size)``
  returns a ``DataModule``.
- ``DataModule.train_batches()`` yields this rank's micro-batches forever, as dicts of
  ``input_ids`` [B, T] and ``labels`` [B, T] (already shifted: ``labels[:, t]`` is the target
  of position t, -100 where no loss is taken), plus any extra model inputs (``position_ids``).
  Every key except ``labels`` is passed to the model.
- ``DataModule.eval_batches()`` returns this rank's held-out micro-batches.
- ``state_dict()`` / ``load_state_dict()`` hold the loader position.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from .config import DataConfig


@dataclass
class DataModule:
    train: torch.Tensor  # [N, T+1] token rows
    eval: torch.Tensor
    micro_batch: int
    dp_rank: int
    dp_world: int
    seed: int
    position: dict[str, int] = field(default_factory=lambda: {"epoch": 0, "index": 0})

    @property
    def stats(self) -> dict[str, float]:
        return {"packing_efficiency": 1.0}

    def _order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.train.shape[0], generator=g)

    def train_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        glob = self.micro_batch * self.dp_world
        while True:
            order = self._order(self.position["epoch"])
            while self.position["index"] + glob <= len(order):
                start = self.position["index"] + self.dp_rank * self.micro_batch
                rows = self.train[order[start:start + self.micro_batch]]
                self.position["index"] += glob
                yield _to_batch(rows)
            self.position = {"epoch": self.position["epoch"] + 1, "index": 0}

    def eval_batches(self, max_batches: int) -> list[dict[str, torch.Tensor]]:
        rows = self.eval[self.dp_rank::self.dp_world]
        out = [_to_batch(rows[i:i + self.micro_batch])
               for i in range(0, len(rows) - self.micro_batch + 1, self.micro_batch)]
        return out[:max_batches]

    def state_dict(self) -> dict[str, Any]:
        return dict(self.position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = {"epoch": int(state["epoch"]), "index": int(state["index"])}


def _to_batch(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}


def _synthetic_rows(n: int, seq_len: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows following x[t+1] = (a * x[t] + b) mod vocab with per-row (a, b): learnable in-context."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(1, 8, (n, 1), generator=g)
    b = torch.randint(0, vocab, (n, 1), generator=g)
    x = torch.empty(n, seq_len + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(seq_len):
        x[:, t + 1] = (a[:, 0] * x[:, t] + b[:, 0]) % vocab
    return x


def build_data(cfg: DataConfig, *, seq_len: int, micro_batch: int, dp_rank: int, dp_world: int,
               seed: int, cache_dir: Path, vocab_size: int) -> DataModule:
    if cfg.name != "synthetic":
        raise ValueError(f"data={cfg.name!r} is not available yet; use data=synthetic")
    rows = _synthetic_rows(cfg.num_records + cfg.eval_records, seq_len, vocab_size, cfg.seed)
    return DataModule(train=rows[: cfg.num_records], eval=rows[cfg.num_records:],
                      micro_batch=micro_batch, dp_rank=dp_rank, dp_world=dp_world, seed=seed)
