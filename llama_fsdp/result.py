"""What a rank hands back to the launcher, in a module that imports nothing heavy: the rank's
supervisor and the launcher unpickle it without importing torch or transformers (seconds per
rank process on a small machine)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RunResult:
    """What a rank hands back to the launcher."""

    rank: int
    status: str  # finished | stopped by the user | preempted
    steps: int
    losses: list[float]  # logged steps (every step with train.log_every=1)
    final: dict[str, float]  # the last logged step's metrics, with the last eval's
    summary: dict[str, float]  # steady-state throughput, peak memory, final losses (MLflow too)
    tokens_seen: int
    mlflow_run_id: Optional[str]
    resumed_from: Optional[str]
    checkpoints: list[str] = field(default_factory=list)
    export_dir: Optional[str] = None
