"""Where a run's ranks run and what each node has: the launcher's answers, as data.

The launcher of ``cluster.kind`` (one of ``LAUNCH_MODES``: launchers/) answers once, before the run is built
(``Launcher.placement``); the spec, its checks and the planner read the answers here and never
ask which launcher it is. A plan for machines that are not here (the docs' tables,
``plan.reference_spec``) states its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# cluster.kind: how the ranks start. launchers.LAUNCHERS has one launcher for each (a test holds
# the two together, and conf/cluster/ to them): local ranks on this host, a SLURM job through
# submitit, or this process as one rank of a job torchrun (or an operator) started.
LOCAL, SLURM, TORCHRUN = "local", "slurm", "torchrun"
LAUNCH_MODES = (LOCAL, SLURM, TORCHRUN)


@dataclass(frozen=True)
class Placement:
    device: str  # "cuda" or "cpu": cluster.device, with auto resolved by what the nodes have
    nodes: int
    nproc_per_node: int  # ranks per node
    # The ranks run on this host, so what this process sees (its GPUs, its RAM) is theirs.
    on_this_host: bool
    # The GPUs one node gives the run: visible here, or what the job asks for; and the number's
    # source, for messages ("visible here", "cluster.gpus_per_node").
    gpus_per_node: int = 0
    # This host's first GPU, where the ranks run here: its name as CUDA reports it, its memory
    # in bytes, and whether it computes in bf16 (None where not known).
    gpu_name: Optional[str] = None
    gpu_memory_bytes: Optional[int] = None
    gpu_bf16: Optional[bool] = None
    # One node's RAM, shared by its ranks (None: not known where the plan is made), where the
    # number comes from, and how a user gives the ranks more (None: a machine's RAM is fixed).
    ram_bytes: Optional[int] = None
    ram_source: str = ""
    more_ram: Optional[str] = None
    # The job waits in a scheduler's queue before its ranks start.
    queued: bool = False
    # SIGTERM is the scheduler's warning that it stops the job (a preemption, a requeue, a
    # cancel), at most this many seconds before its SIGKILL: the ranks save and stop at their
    # next log step when a save fits (train/stopping.py). None: SIGTERM is no warning here.
    stop_warning_s: Optional[int] = None
    # What this launcher cannot do with the config, each with its fix.
    problems: tuple[str, ...] = ()
