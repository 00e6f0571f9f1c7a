"""Dispatch a RunSpec to local rank processes or to SLURM nodes (both through submitit)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

from .common import Entry, Interrupted, LaunchError, RankFailure

if TYPE_CHECKING:
    from ..spec import RunSpec

log = logging.getLogger(__name__)


def preflight(spec: RunSpec) -> list[str]:
    """What this machine lacks to launch the run (checked before any preparation)."""
    import shutil
    import subprocess

    if spec.cluster.kind != "slurm":
        return []
    if shutil.which("sbatch") is None:
        return ["cluster=slurm but sbatch is not on PATH: this is not a SLURM login node. Run "
                "from one, use cluster=local, or add dry_run=true to see the job script"]
    # SLURM's commands are here: does its controller answer? (sinfo reads the same config and
    # asks the same slurmctld as sbatch; a login node answers in well under a second)
    try:
        out = subprocess.run(["sinfo", "--noheader", "--format=%P"], capture_output=True,
                             text=True, timeout=30)
        problem = None if out.returncode == 0 else (out.stderr.strip().splitlines() or ["?"])[-1]
    except (OSError, subprocess.TimeoutExpired) as e:
        problem = f"sinfo did not answer: {e}"
    if problem:
        return [f"cluster=slurm but the SLURM controller does not answer here ({problem}). Run "
                "from a login node of the cluster (or set SLURM_CONF), use cluster=local, or add "
                "dry_run=true to see the job script"]
    return []


def launch(spec: RunSpec, entry: Entry, *, stream: bool = True,
           on_submitted: Optional[Callable[[str, bool], None]] = None) -> Any:
    """Run `entry(spec)` on every rank; local runs wait, SLURM runs wait if cluster.wait.
    ``stream``: copy rank 0's log to this terminal while the job runs (callers that read the
    logs themselves, as the tests do, pass False). ``on_submitted(job_id, detached)``: told a
    SLURM job's id once submitted (detached: this call returns without waiting for it)."""
    from .submitit_compat import check_version

    if (warning := check_version()) is not None:
        log.warning("%s", warning)
    match spec.cluster.kind:
        case "local":
            from .local import launch_local

            return launch_local(spec, entry, stream=stream)
        case "slurm":
            from .slurm import launch_slurm

            return launch_slurm(spec, entry, stream=stream, on_submitted=on_submitted)
        case other:
            raise ValueError(f"cluster.kind={other!r} is not one of local, slurm")


__all__ = ["Entry", "Interrupted", "LaunchError", "RankFailure", "launch", "preflight"]
