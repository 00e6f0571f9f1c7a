"""Step-end wall-clock stamps on rank 0, the one timing method of benchmarks/throughput.py.

Every runner records ``time.time()`` at the end of every optimizer step on rank 0 and appends
``{"step": n, "t": ..., "cpu": ...}`` to the JSON-lines file named by ``$BENCH_STEP_CLOCK``;
per-step wall time is the difference of consecutive ``t``. ``cpu`` is rank 0's process CPU
time (all its threads): its per-step difference is the work the rank did, which other load on
the machine moves much less, so it tells a real gap from a noisy wall clock. llama_fsdp calls
``StepClock`` through its ``train.callbacks`` seam
(``train.callbacks=["benchmarks.step_clock:StepClock"]``); the peer loops in benchmarks/peers/
call ``StepClock.stamp`` from their own step ends. Nothing here imports llama_fsdp: this module
must keep working while the framework is restructured.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, TextIO

CLOCK_ENV = "BENCH_STEP_CLOCK"


def _synchronize() -> None:
    """Wait for queued CUDA work, so a stamp marks a finished step, not an enqueued one."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepClock:
    """The ``train.callbacks`` factory and the step hook in one.

    ``StepClock(rank=..., world_size=..., output_dir=...)`` is called once per rank and returns
    the hook; ``hook(state)`` stamps ``state.step``. Only rank 0 writes, and only when
    ``$BENCH_STEP_CLOCK`` is set, so the hook costs nothing elsewhere.
    """

    def __init__(self, *, rank: int, world_size: int = 1, output_dir: str | None = None):
        path = os.environ.get(CLOCK_ENV)
        self._file: TextIO | None = (
            open(path, "a", encoding="utf-8") if rank == 0 and path else None  # noqa: SIM115
        )

    def __call__(self, state: Any) -> None:
        self.stamp(int(state.step))

    def stamp(self, step: int) -> None:
        """Append this step's end time; flushed at once so a crashed run keeps its stamps."""
        if self._file is None:
            return
        _synchronize()
        stamp = {"step": step, "t": time.time(), "cpu": time.process_time()}
        self._file.write(json.dumps(stamp) + "\n")
        self._file.flush()


def read_stamps(path: Path, key: str = "t") -> dict[int, float]:
    """Step number -> that step's ``key`` stamp from a clock file (missing file: no stamps)."""
    if not path.exists():
        return {}
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {int(r["step"]): float(r[key]) for r in rows if key in r}


def step_walls(stamps: dict[int, float], *, warmup: int) -> list[float]:
    """Seconds of every steady step: s[n] - s[n-1] for the steps after ``warmup``."""
    return [stamps[n] - stamps[n - 1] for n in sorted(stamps) if n > warmup and n - 1 in stamps]
