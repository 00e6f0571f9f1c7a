"""What a rank hands back to the launcher, in a module that imports nothing heavy: the rank's
supervisor and the launcher unpickle it without importing torch or transformers. With it, the
two vocabularies of a run's end, one table each: how it ended (``STATUSES``) and the summary/*
metrics it ends with (``SUMMARY``)."""
from __future__ import annotations

from dataclasses import astuple, dataclass, field
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


@dataclass(frozen=True)
class SummaryMetrics:
    """The summary/* metrics a run ends with: the worker logs them, MLflow's runs table sorts on
    them, the end-of-run summary and the sweep table read them."""

    tokens_per_sec: str = "summary/tokens_per_sec"  # global, median of the steady steps
    tokens_per_sec_per_device: str = "summary/tokens_per_sec_per_device"
    step_time_s: str = "summary/step_time_s"  # median of the steady steps
    mfu: str = "summary/mfu"  # model FLOP utilisation against the device's peak (CUDA)
    peak_memory_gb: str = "summary/peak_memory_gb"  # max over ranks: CUDA allocated, or RSS
    predicted_peak_memory_gb: str = "summary/predicted_peak_memory_gb"  # the plan's tensors
    final_loss: str = "summary/final_loss"
    eval_loss: str = "summary/eval_loss"
    eval_exact_match: str = "summary/eval_exact_match"

    @property
    def names(self) -> tuple[str, ...]:
        return astuple(self)


SUMMARY = SummaryMetrics()
SUMMARY_PREFIX = "summary/"


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
