"""Dispatch a RunSpec to local rank processes or to SLURM nodes (both through submitit)."""
from __future__ import annotations

from typing import Any

from .common import Entry, Interrupted, LaunchError, RankFailure


def preflight(spec: Any) -> list[str]:
    """What this machine lacks to launch the run (checked before any preparation)."""
    import shutil

    if spec.cluster.kind == "slurm" and shutil.which("sbatch") is None:
        return ["cluster=slurm but sbatch is not on PATH: this is not a SLURM login node. Run "
                "from one, use cluster=local, or add dry_run=true to see the job script"]
    return []


def launch(spec: Any, entry: Entry, *, stream: bool = True) -> Any:
    """Run `entry(spec)` on every rank; local runs wait, SLURM runs wait if cluster.wait."""
    match spec.cluster.kind:
        case "local":
            from .local import launch_local

            return launch_local(spec, entry, stream=stream)
        case "slurm":
            from .slurm import launch_slurm

            return launch_slurm(spec, entry, stream=stream)
        case other:
            raise ValueError(f"cluster.kind={other!r} is not one of local, slurm")


__all__ = ["Entry", "Interrupted", "LaunchError", "RankFailure", "launch", "preflight"]
