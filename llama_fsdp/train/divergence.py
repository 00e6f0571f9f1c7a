"""A loss that runs away stops the run before it turns into NaN, with a report instead of a
traceback (train.divergence: config/schema.py's DivergenceConfig says the rule).

Every rank reads the same global loss at a log step (the loop's one reduction), so every rank
comes to the same verdict at the same step, and they stop together. A step whose loss the guard
suspects is not saved, so the last checkpoint a diverged run leaves is a good one.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from ..config.schema import DivergenceConfig

log = logging.getLogger(__name__)

RECENT = 6  # log steps the report shows
DIVERGED_FILE = "diverged.txt"  # in the run directory: the report and the traceback


class Diverged(Exception):
    """The loss ran away at ``step``: raised on every rank at the same log step."""

    def __init__(self, step: int, recent: list[tuple[int, float]], best: float, why: str,
                 lr: Optional[float] = None):
        self.step, self.recent, self.best, self.why, self.lr = step, recent, best, why, lr
        shown = ", ".join(f"{s}: {v:.4g}" for s, v in recent)
        super().__init__(f"the loss diverged at step {step} ({why}); the last losses by step: "
                         f"{shown}")


@dataclass
class DivergenceGuard:
    cfg: DivergenceConfig
    best: float = math.inf  # the lowest median of a window so far
    high: bool = False  # the last loss read is above the line itself
    warned: bool = False

    def __post_init__(self) -> None:
        self.recent: deque[tuple[int, float]] = deque(maxlen=max(RECENT, self.cfg.window))

    @property
    def suspect(self) -> bool:
        """The last loss read is above the line (a step not to save)."""
        return self.high

    def observe(self, step: int, loss: float, lr: Optional[float] = None) -> None:
        """A log step's global loss (and the learning rate its step used); raises Diverged
        when the rule says so."""
        c = self.cfg
        self.recent.append((step, loss))
        shown = list(self.recent)[-RECENT:]
        if not math.isfinite(loss):
            raise Diverged(step, shown, self.best, f"the loss is {loss}", lr)
        window = sorted(v for _, v in list(self.recent)[-c.window:])
        median = window[(len(window) - 1) // 2]  # (the lower one of an even count)
        self.high = c.action != "off" and self.above(loss)
        if c.action == "off" or not self.above(median):
            self.best = min(self.best, median)
            return
        why = (f"the median of the last {len(window)} log steps' losses, {median:.4g}, is "
               f"{median / self.best:.3g}x the lowest so far ({self.best:.4g}) and "
               f"{median - self.best:.4g} above it")
        if c.action == "stop":
            raise Diverged(step, shown, self.best, why, lr)
        if not self.warned:  # warn: once, and train on
            self.warned = True
            log.warning("%s (train.divergence.action=warn: training on)",
                        Diverged(step, shown, self.best, why, lr))

    def state_dict(self) -> dict[str, Any]:
        """The history a resumed run judges its steps by (saved with each checkpoint)."""
        return {"best": self.best, "recent": [list(r) for r in self.recent], "high": self.high,
                "warned": self.warned}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """A checkpoint's history; the thresholds stay this run's (train.divergence)."""
        self.best, self.high, self.warned = float(sd["best"]), bool(sd["high"]), bool(sd["warned"])
        self.recent.clear()
        self.recent.extend((int(s), float(v)) for s, v in sd["recent"])

    def above(self, value: float) -> bool:
        c = self.cfg
        return value >= self.best * c.ratio and value - self.best >= c.min_rise


def report(err: Diverged, *, peak_lr: float, source: str,
           recipe_lr: Optional[float], last_good: Optional[str]) -> str:
    """What a user reads when a run diverged: where, the curve, the learning rate in use against
    the recipe's, what is kept, and the fix."""
    given = not source.startswith("recipe")
    lr = (f"learning rate at step {err.step}: "
          + (f"{err.lr:.3g} " if err.lr is not None else "")
          + f"(peak {peak_lr:.3g}, {source}"
          + (f"; the recipe's is {recipe_lr:.3g}" if given and recipe_lr is not None else "")
          + ")")
    lower = (f"train.lr={recipe_lr:.3g} (the recipe's: or drop the override)"
             if given and recipe_lr is not None and recipe_lr < peak_lr
             else f"train.lr={peak_lr / 10:.3g}")
    kept = (f"last good checkpoint: {last_good}" if last_good else
            "no checkpoint was saved before it (save.every_steps)")
    fix = (f"fix: lower the learning rate, e.g. {lower}; or a longer warm-up "
           "(train.warmup_steps) or a tighter clip (train.max_grad_norm). "
           "train.divergence.action=warn only warns and trains on")
    return "\n".join([str(err), lr, kept, fix])
