"""What a rank hands back to the launcher, in a module that imports nothing heavy: the rank's
supervisor and the launcher unpickle it without importing torch or transformers. With it, the
table of how a run ends (``STATUSES``); the names of the metrics it ends with are
metric_names.py's."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# How a rank's run ended (RunResult.status, run_status.json), and the MLflow run status each
# is recorded with. A preempted rank's supervisor hands over to submitit, which requeues the job
# (launchers/rank.py); a stopped run resumes with resume=auto.
FINISHED = "finished"
USER_STOPPED = "stopped by the user"
PREEMPTED = "preempted"
FAILED = "FAILED"
STATUSES = {FINISHED: "FINISHED", USER_STOPPED: "KILLED", PREEMPTED: "KILLED", FAILED: "FAILED"}


def mlflow_status(status: str) -> str:
    """The MLflow run status of a run that ended with ``status`` (one of STATUSES)."""
    return STATUSES[status]


@dataclass
class RunResult:
    """What a rank hands back to the launcher."""

    rank: int
    status: str  # one of STATUSES
    steps: int
    losses: list[float]  # logged steps (every step with train.log_every=1)
    final: dict[str, float]  # the last logged step's metrics, with the last eval's
    summary: dict[str, float]  # steady-state throughput, peak memory, final losses (MLflow too)
    tokens_seen: int
    mlflow_run_id: Optional[str]
    resumed_from: Optional[str]
    checkpoints: list[str] = field(default_factory=list)
    export_dir: Optional[str] = None
