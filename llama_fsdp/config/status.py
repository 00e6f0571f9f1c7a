"""How a run ends, and what a rank hands back to the launcher, in a module that imports nothing
heavy: the rank's supervisor and the launcher unpickle it without importing torch or
transformers. One table of the statuses (``STATUSES``: how a rank's run ended, and the MLflow
run status each is recorded with) and the words the runs table's status column says
(``STATUS_WORDS``); the names of the metrics a run ends with are metrics.py's."""
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
DIVERGED = "diverged"  # the loss ran away (train/divergence.py): the run stopped with a report
PRUNED = "pruned"  # a search's pruner stopped the trial at an eval step (train/pruning.py)

# MLflow's run statuses
MLFLOW_RUNNING = "RUNNING"
MLFLOW_SCHEDULED = "SCHEDULED"
MLFLOW_FINISHED = "FINISHED"
MLFLOW_FAILED = "FAILED"
MLFLOW_KILLED = "KILLED"

STATUSES = {FINISHED: MLFLOW_FINISHED, USER_STOPPED: MLFLOW_KILLED, PREEMPTED: MLFLOW_KILLED,
            FAILED: MLFLOW_FAILED, DIVERGED: MLFLOW_FAILED, PRUNED: MLFLOW_KILLED}
# the command's exit code for a run that diverged (2: refused before launch, 1: failed)
EXIT_DIVERGED = 3

# The runs table's status column (the "status" tag): a run's MLflow status as words, and the
# words before MLflow has one (a run created, its job queued or its ranks starting, or its job
# back in the queue)
QUEUED = "queued"
STARTING = "starting"
REQUEUED = "requeued"  # its job was requeued (a preemption, an admin's requeue): SCHEDULED again
STATUS_WORDS = {MLFLOW_RUNNING: "running", MLFLOW_SCHEDULED: QUEUED, MLFLOW_FINISHED: "finished",
                MLFLOW_FAILED: "failed", MLFLOW_KILLED: "stopped"}
# a run's own word for the status column where MLflow's status says less (diverged: FAILED;
# pruned: KILLED)
OWN_WORDS = {DIVERGED: DIVERGED, PRUNED: PRUNED}


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
    report: Optional[str] = None  # what went wrong and its fix (a run that diverged)
