"""cluster=torchrun: this process is one rank of a job that torchrun, a Kubernetes operator
(Kubeflow's PyTorchJob or TrainJob, JobSet) or SkyPilot started, and every process of the job runs
`python -m llama_fsdp cluster=torchrun ...` itself.

What the local and SLURM launchers do once, in the process that launches, happens once per job
here, inside the job, after the process group is up (``once_per_job``):

- the first rank of every node prepares that node: the model files (a hub name is downloaded
  into the node's cache) and the tokenized data in its cache. Tokenization is deterministic, so
  nodes without a shared filesystem build identical rows; with one, the cache's file lock lets
  one build and the others find it;
- global rank 0 does the job's part: reaches the tracking store, writes config.yaml, creates
  (or continues) the MLflow run, and owns the run directory to the end;
- every rank then agrees: a failure on any rank stops every rank with its message, before any
  model is built.

torchrun's ``--max-restarts`` restarts every process; a restarted attempt
(TORCHELASTIC_RESTART_COUNT > 0) resumes from the newest complete checkpoint, as
``cluster.max_restarts`` does for the other launchers. Checkpoints of a job on several nodes
need a filesystem every node shares (DCP writes each rank's shards where the rank runs).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"


def restart_count() -> int:
    """How many times torchrun restarted this job's processes (0 for the first attempt)."""
    return int(os.environ.get(RESTART_ENV) or 0)


def job_run_id() -> Optional[str]:
    """torchrun's rendezvous id, the same in every process and every restart (None without
    one, as in a bare RANK / WORLD_SIZE launch)."""
    run_id = os.environ.get(RUN_ID_ENV)
    return run_id if run_id and run_id != "none" else None


def rank() -> int:
    return int(os.environ.get("RANK") or 0)


def once_per_job(env: Any, *, node: Callable[[], Any], job: Callable[[], Optional[str]]
                 ) -> Optional[str]:
    """Run ``node()`` on the first rank of every node but the first, and ``job()`` (the node's
    duties and the job's) on global rank 0 (collective: every rank calls it, with the process
    group up). A failure anywhere is raised on every rank with the first failing rank's message.
    ``job`` may return why there is nothing to train (a finished run); every rank returns it."""
    import torch.distributed as dist

    outcome: tuple[Optional[str], Optional[str]] = (None, None)
    try:
        if env.rank == 0:
            outcome = (None, job())
        elif env.local_rank == 0:
            node()
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, or they would wait
        outcome = (f"rank {env.rank}: {e}", None)
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    first = next((err for err, _ in outcomes if err), None)
    if first is not None:
        raise JobPreparationError(first)
    return outcomes[0][1]


class JobPreparationError(RuntimeError):
    """A rank could not prepare its node or the job; every rank stops with this message."""


class NothingToTrain(Exception):
    """Raised on every rank when the job has nothing to train (a finished run)."""
