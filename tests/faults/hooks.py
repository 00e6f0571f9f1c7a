"""Faults injected into real rank processes through the loop's step-hook seam
(``train.callbacks=[tests.faults.hooks:<name>]``), parameterized by environment variables the
tests set. Production code knows nothing of them.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Callable

KILL_SAVE_STEP = "LLAMA_FSDP_TEST_KILL_SAVE_STEP"  # every rank exits mid-save of this step
CRASH = "LLAMA_FSDP_TEST_CRASH"  # "rank=R,step=S": rank R raises after step S
SIGNAL = "LLAMA_FSDP_TEST_SIGNAL"  # "rank=R,step=S,sig=KILL": rank R sends itself a signal
MARK = "LLAMA_FSDP_TEST_MARK"  # a file: its first line says whether this fault already fired
SLOW = "LLAMA_FSDP_TEST_STEP_SLEEP"  # seconds every rank sleeps after each step
SLOW_FIRST = "LLAMA_FSDP_TEST_STEP_SLEEP_FIRST_ATTEMPT"  # "1": only until a restart or requeue
STALL = "LLAMA_FSDP_TEST_STALL"  # "step=S,seconds=T": every rank sleeps T s after step S, once
EXIT_CODE = 86


def _spec(var: str) -> dict[str, str]:
    return dict(kv.split("=") for kv in os.environ[var].split(","))


def _once() -> bool:
    """True the first time in a run (a restarted run must not fail again): marks the file."""
    mark = os.environ.get(MARK)
    if not mark:
        return True
    path = Path(mark)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def kill_during_save(*, rank: int, world_size: int, output_dir: str) -> Callable[[Any], None]:
    """Every rank exits after writing its data files of step N's checkpoint, before DCP's
    metadata and the publish: what a kill during a save leaves behind."""
    from torch.distributed.checkpoint import FileSystemWriter

    step = int(os.environ[KILL_SAVE_STEP])
    original = FileSystemWriter.write_data

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        fut = original(self, plan, planner)
        if Path(str(self.path)).name == f"step_{step:06d}.tmp":
            fut.wait()
            os._exit(EXIT_CODE)
        return fut

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    return lambda state: None


def crash(*, rank: int, world_size: int, output_dir: str) -> Callable[[Any], None]:
    """Rank R raises after step S."""
    want = _spec(CRASH)

    def hook(state: Any) -> None:
        if rank == int(want["rank"]) and state.step == int(want["step"]) and _once():
            raise RuntimeError(f"injected fault on rank {rank} after step {state.step}")

    return hook


def self_signal(*, rank: int, world_size: int, output_dir: str) -> Callable[[Any], None]:
    """Rank R sends itself a signal after step S (SIGKILL: what the OOM killer does)."""
    want = _spec(SIGNAL)
    sig = getattr(signal, "SIG" + want.get("sig", "KILL"))

    def hook(state: Any) -> None:
        if rank == int(want["rank"]) and state.step == int(want["step"]) and _once():
            os.kill(os.getpid(), sig)

    return hook


def _restarted() -> bool:
    """Whether this is a restarted or requeued attempt of the run."""
    return any(int(os.environ.get(v) or 0) > 0
               for v in ("LLAMA_FSDP_ATTEMPT", "SLURM_RESTART_COUNT"))


def stall(*, rank: int, world_size: int, output_dir: str) -> Callable[[Any], None]:
    """Every rank sleeps after step S in the run's first attempt (not once restarted or
    requeued): a job that a test stops there has logged step S, and has no checkpoint of it."""
    import time

    want = _spec(STALL)
    if _restarted():
        return lambda state: None

    def hook(state: Any) -> None:
        if state.step == int(want["step"]):
            time.sleep(float(want["seconds"]))

    return hook


def slow(*, rank: int, world_size: int, output_dir: str) -> Callable[[Any], None]:
    """Every rank sleeps after each step (so a test can act while a run is mid-way); with
    SLOW_FIRST=1 only in the run's first attempt (not once restarted or requeued by SLURM)."""
    import time

    seconds = float(os.environ[SLOW])
    if _restarted() and os.environ.get(SLOW_FIRST) == "1":
        return lambda state: None
    return lambda state: time.sleep(seconds)


DISK_FULL_STEP = "LLAMA_FSDP_TEST_DISK_FULL_STEP"  # the data files of this step's save hit ENOSPC


def disk_full_at_save(*, rank: int, world_size: int, output_dir: str) -> Callable[[Any], None]:
    """The data files of step N's checkpoint are written to /dev/full, whose every write fails
    with ENOSPC (No space left on device), as a full disk's do."""
    import contextlib

    from torch.distributed.checkpoint.filesystem import FileSystem

    step = int(os.environ[DISK_FULL_STEP])
    original = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Any:
        target = Path(str(path))
        if target.parent.name == f"step_{step:06d}.tmp" and target.suffix == ".distcp":
            with open("/dev/full", "wb") as stream:
                yield stream
            return
        with original(self, path, mode) as stream:
            yield stream

    FileSystem.create_stream = create_stream  # type: ignore[method-assign]
    return lambda state: None


PREP_STARTED = "LLAMA_FSDP_TEST_PREP_STARTED"  # a file the slow data.preprocess hook touches


def slow_preprocess(record: dict) -> dict:
    """data.preprocess that takes its time (data preparation an interrupt can land in) and says
    it has started (the file PREP_STARTED names)."""
    import time

    if (marker := os.environ.get(PREP_STARTED)) and not Path(marker).exists():
        Path(marker).write_text("started")
    time.sleep(0.05)
    return record
