"""The process title of a rank's processes, so that `ps`, `top`, py-spy or a cluster's tools
tell the ranks of a run apart: a rank forked from the controller would otherwise keep its
command line (and /proc environment), and look like every other process of the run.

    llama_fsdp rank 1/2 worker (run 08-56-04-108897)      ps -o args: the full title
    lf1/2 worker                                          ps -o comm, top: 15 bytes at most

The full title replaces argv (setproctitle, a dependency; it also moves the environment out of
the way, so /proc/<pid>/cmdline shows the title); the short name is the kernel's comm
(prctl PR_SET_NAME), set with ctypes when setproctitle is missing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

PR_SET_NAME = 15  # linux/prctl.h
COMM_BYTES = 15  # the kernel's TASK_COMM_LEN, less its NUL


def rank_title(rank: int, world: int, role: str, output_dir: str) -> str:
    """``llama_fsdp rank 1/2 worker (run <run dir's name>)``."""
    return f"llama_fsdp rank {rank}/{world} {role} (run {os.path.basename(output_dir.rstrip('/'))})"


def short_name(rank: int, world: int, role: str) -> str:
    """The kernel's name for the process (``top``, ``ps -o comm``): ``lf1/2 worker``."""
    return f"lf{rank}/{world} {role}"[:COMM_BYTES]


def set_title(rank: int, world: int, role: str, output_dir: str) -> None:
    """Name this process as rank ``rank`` of ``world``'s ``role`` (worker, supervisor)."""
    try:
        import setproctitle
    except ImportError:
        setproctitle = None
    # Not under SLURM: with a title (setproctitle's, or even only the kernel's comm), a SLURM
    # job's ranks stopped reacting to the time limit's USR2 (measured: tests/integration/
    # test_slurm_launch.py's preemption test trained its 30 steps instead of checkpointing and
    # requeueing); the cause is not found yet, so SLURM's ranks keep their command line.
    if "SLURM_JOB_ID" in os.environ:
        return
    if setproctitle is not None:
        setproctitle.setproctitle(rank_title(rank, world, role, output_dir))
    _set_comm(short_name(rank, world, role))  # after setproctitle, which sets comm to its head


def _set_comm(name: str) -> None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:COMM_BYTES]), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the title is a convenience, never a failure
        pass
