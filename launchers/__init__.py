"""Dispatch a RunSpec to local rank processes or to SLURM nodes (both through submitit)."""
from __future__ import annotations

from typing import Any

from .common import Entry, LaunchError


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


__all__ = ["launch", "LaunchError"]
