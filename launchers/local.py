"""Local launch: submitit's local executor starts one process per rank on this host."""
from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

from .common import Entry, RankEntry, clear_stale_errors, watch, worker_env

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(spec: Any, entry: Entry, *, stream: bool = True) -> list[Any]:
    """Run `entry(spec)` on spec.nproc_per_node local ranks; return each rank's result."""
    import submitit

    folder = Path(spec.output_dir) / "submitit"
    folder.mkdir(parents=True, exist_ok=True)
    clear_stale_errors(spec.output_dir)
    executor = submitit.LocalExecutor(folder=folder)
    executor.update_parameters(tasks_per_node=spec.nproc_per_node, nodes=1,
                               timeout_min=spec.cluster.time_min)
    os.environ.update(worker_env())  # the local controller passes its environment to the ranks
    job = executor.submit(RankEntry(entry, master_addr="127.0.0.1", master_port=free_port()), spec)
    log.info("started %d local rank(s) (job %s); logs in %s", spec.nproc_per_node, job.job_id, folder)
    return watch(job, spec.output_dir, stream=stream)
