"""The loop's counters, what a checkpoint carries to continue a run exactly (a leaf: the loop,
the checkpointer and the stop handler share it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    """Counters a checkpoint must carry to continue a run exactly."""

    step: int = 0
    tokens_seen: int = 0
    losses: list[float] = field(default_factory=list)  # the logged steps' losses (this process)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
