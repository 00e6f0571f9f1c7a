"""One live owner per run directory.

A launch holds its run directory from preparation to the end of its ranks: an exclusive
``flock`` on ``<run>/owner.lock``, which the kernel releases when the process ends however it
ends (a SIGKILL, a crash), and ``<run>/owner.json`` saying who holds it (host, pid, since, the
command). A second launch into a live run's directory is refused at once with that record, and so is a
launch into a directory that is neither empty nor a run's (it holds the user's files). A
record whose lock is free was left by an owner that died: the directory is taken over (the
caller says so, and resume=auto continues from the newest checkpoint). A SLURM job submitted
without waiting (cluster.wait=false) outlives its launcher: its record keeps the job id, and the
directory stays owned while SLURM still has the job.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator, Optional

from ..config.rundir import OWNER, OWNER_LOCK, RUN_MARKERS, RunDir, claim_problem, replace_text


class RunDirBusy(RuntimeError):
    """The run directory cannot be taken: another live launch owns it, or it holds what no run
    wrote (rundir.claim_problem)."""


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _slurm_job_live(job_id: str) -> Optional[str]:
    """The state of a SLURM job that is still queued or running, else None."""
    try:
        out = subprocess.run(["squeue", "--noheader", "--jobs", job_id, "--format=%T"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = out.stdout.strip().splitlines()
    return state[0] if out.returncode == 0 and state else None


def detached_job(output_dir: str) -> tuple[Optional[str], Optional[str]]:
    """The SLURM job a run submitted without waiting lives in (its record keeps the id), and
    its state while SLURM still queues or runs it (None: over, or no such job)."""
    job = _read(RunDir(output_dir).owner).get("slurm_job")
    return (str(job), _slurm_job_live(str(job))) if job else (None, None)


def _describe(rec: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.get("since", 0)))
    return f"pid {rec.get('pid')} on {rec.get('host')} since {since} ({rec.get('command', '?')})"


class Ownership:
    """This launch's hold on a run directory (``own``)."""

    def __init__(self, output_dir: str):
        self.dir = RunDir(output_dir)
        self.record = self.dir.owner
        self.previous: dict = {}
        self.detached = False
        self.made_lock = False  # this launch made owner.lock (the directory had none)
        self._fd: Optional[int] = None

    def slurm_job(self, job_id: str, detached: bool) -> None:
        """The run now lives in a SLURM job, which outlives this process if it does not wait
        for it (``detached``), or if this process is killed while it waits."""
        self.detached = detached
        rec = _read(self.record)
        replace_text(self.record, json.dumps({**rec, "slurm_job": str(job_id)}))

    def release(self, *, keep_record: bool = False) -> None:
        if self._fd is None:
            return
        if not keep_record:
            self.record.unlink(missing_ok=True)
        os.close(self._fd)  # the lock goes with the descriptor
        self._fd = None
        others = [m for m in RUN_MARKERS if m not in (OWNER, OWNER_LOCK)]
        if self.made_lock and not keep_record and not any(
                (self.dir.root / m).exists() for m in others):
            self.dir.owner_lock.unlink(missing_ok=True)  # nothing of a run here: no marker


@contextlib.contextmanager
def own(output_dir: str, *, command: str) -> Iterator[Ownership]:
    """Hold ``output_dir`` while the block runs; raise RunDirBusy if a live launch holds it.
    ``Ownership.previous`` is the record of a dead owner that was taken over ({} if none)."""
    o = Ownership(output_dir)
    if (problem := claim_problem(output_dir)) is not None:
        raise RunDirBusy(problem)
    try:
        o.dir.root.mkdir(parents=True, exist_ok=True)
        o.made_lock = not o.dir.owner_lock.exists()
        fd = os.open(o.dir.owner_lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # below a file, on /proc or /sys, a read-only folder
        raise RunDirBusy(f"cannot make the run directory {output_dir} ({e.strerror or e} at "
                         f"{e.filename or output_dir}): choose an output_dir where you may "
                         "write") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        rec = _read(o.record)
        raise RunDirBusy(
            f"{output_dir} is in use by a live launch: {_describe(rec)}. Wait for it to end "
            f"(or stop it: kill {rec.get('pid')} on {rec.get('host')}), or launch into another "
            "output_dir") from None
    o._fd = fd
    previous = _read(o.record)
    job = previous.get("slurm_job")
    if job and (state := _slurm_job_live(job)) is not None:
        o.release(keep_record=True)
        raise RunDirBusy(
            f"{output_dir} belongs to SLURM job {job} ({state}), submitted by {_describe(previous)}."
            f" Wait for it to end (squeue -j {job}) or cancel it (scancel {job}), or launch into "
            "another output_dir")
    o.previous = previous
    replace_text(o.record, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                       "since": time.time(), "command": command}))
    try:
        yield o
    finally:
        o.release(keep_record=o.detached)
