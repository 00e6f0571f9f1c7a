"""Rank 0's progress bar and messages; every other rank holds ``NullConsole``."""
from __future__ import annotations

import logging
import sys
from typing import Any

from ..config import metrics as m

log = logging.getLogger(__name__)


class Console:
    """Rank 0's progress bar and messages."""

    def __init__(self, total: int, initial: int = 0):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step",
                        dynamic_ncols=True, file=sys.stderr, mininterval=0.5)

    def set_initial(self, step: int) -> None:
        self.bar.n = self.bar.initial = step
        self.bar.refresh()

    def update(self, step: int, metrics: dict[str, float]) -> None:
        self.bar.n = step
        self.bar.set_postfix(loss=f"{metrics[m.LOSS]:.4f}", lr=f"{metrics[m.LR]:.2e}",
                             tok_s=f"{metrics[m.TOKENS_PER_SEC]:.0f}", refresh=False)
        self.bar.refresh()

    def info(self, msg: str, *args: Any) -> None:
        self.bar.clear()
        log.info(msg, *args)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class NullConsole:
    def set_initial(self, step: int) -> None: ...
    def update(self, step: int, metrics: dict[str, float]) -> None: ...
    def info(self, msg: str, *args: Any) -> None: ...
    def close(self) -> None: ...
