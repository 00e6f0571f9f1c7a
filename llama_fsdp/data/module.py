"""DataModule: this rank's share of the packed rows (resumable train batches, lockstep eval
batches)."""
from __future__ import annotations

import logging
import math
from typing import Any, Iterator, Optional

import numpy as np
import torch

from .packing import Packed

log = logging.getLogger(__name__)


class DataModule:
    """This rank's view of the packed data: train batches (stateful), eval batches, task metric."""

    def __init__(self, *, train: Packed, eval: Packed, tokenizer, micro_batch: int, dp_rank: int,
                 dp_world: int, seed: int, stats: dict[str, float], info: Any = None):
        self.train, self.eval, self.tokenizer = train, eval, tokenizer
        self.micro_batch, self.dp_rank, self.dp_world, self.seed = micro_batch, dp_rank, dp_world, seed
        self._stats = stats
        # The data in words: a report.DataInfo (tokenizer used, split, notes) from build_data.
        self.info = info
        self.position = {"epoch": 0, "index": 0}
        self._order_cache: tuple[int, np.ndarray] | None = None
        if len(train) == 0:
            raise ValueError("no packed training rows: no record to train on")
        # Fewer rows than one global batch (a tiny file): an epoch repeats the rows, each
        # repetition in its own order, until it fills one.
        self.repeats = max(1, math.ceil(micro_batch * dp_world / len(train)))

    @property
    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    @property
    def epoch_rows(self) -> int:
        """Rows per epoch: every training row, ``repeats`` times."""
        return len(self.train) * self.repeats

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches per rank per epoch (the tail that cannot fill a global batch is skipped)."""
        return self.epoch_rows // (self.micro_batch * self.dp_world)

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's permutation of training rows (same on every rank; seed + epoch)."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            perm = np.concatenate([rng.permutation(len(self.train)) for _ in range(self.repeats)])
            self._order_cache = (epoch, perm)
        return self._order_cache[1]

    def train_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's micro-batches forever; ``position`` counts global rows used this epoch.

        Each global batch is ``micro_batch x dp_world`` consecutive rows of the epoch order, and
        rank r takes the r-th slice, so ranks are disjoint and together cover the epoch.
        """
        glob_b = self.micro_batch * self.dp_world
        while True:
            epoch, index = self.position["epoch"], self.position["index"]
            if index + glob_b > self.epoch_rows:
                self.position = {"epoch": epoch + 1, "index": 0}
                continue
            start = index + self.dp_rank * self.micro_batch
            rows = self.order(epoch)[start:start + self.micro_batch]
            self.position = {"epoch": epoch, "index": index + glob_b}
            yield self.train.batch(rows)

    def eval_batches(self, max_batches: Optional[int] = None) -> list[dict[str, torch.Tensor]]:
        """This rank's held-out micro-batches: the same count and shapes on every rank.

        Ranks take consecutive blocks of eval rows, filled up with dummy rows (no labels) to
        whole micro-batches: every eval row counts once, ranks stay in lockstep for FSDP, and
        every batch has the training shape (no recompiles).
        """
        per_rank = math.ceil(len(self.eval) / self.dp_world / self.micro_batch) * self.micro_batch
        rows = np.arange(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
        rows[rows >= len(self.eval)] = -1
        out = []
        for i in range(0, per_rank, self.micro_batch):
            if max_batches is not None and len(out) >= max_batches:
                break
            out.append(self.eval.batch(rows[i:i + self.micro_batch]))
        return out

    def state_dict(self) -> dict[str, int]:
        return {**self.position, "rows": len(self.train)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rows = int(state.get("rows", len(self.train)))
        if rows != len(self.train):
            log.warning("loader state is for %d training rows, this data has %d: resuming at the "
                        "start of epoch %d", rows, len(self.train), int(state["epoch"]) + 1)
            self.position = {"epoch": int(state["epoch"]) + 1, "index": 0}
            return
        self.position = {"epoch": int(state["epoch"]), "index": int(state["index"])}
