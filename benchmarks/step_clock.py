"""Step-end wall-clock stamps on rank 0, the one timing method of benchmarks/throughput.py.

Every runner stamps the end of every optimizer step on rank 0 and appends
``{"step": n, "t": ..., "cpu": ...}`` to the JSON-lines file named by ``$BENCH_STEP_CLOCK``;
per-step wall time is the difference of consecutive ``t``: ``time.time()`` when the step
returned on the CPU, the step's CUDA event on the GPU (no host sync per step). ``cpu`` is rank 0's process CPU
time (all its threads): its per-step difference is the work the rank did, which other load on
the machine moves much less, so it tells a real gap from a noisy wall clock. llama_fsdp calls
``StepClock`` through its ``train.callbacks`` seam
(``train.callbacks=["benchmarks.step_clock:StepClock"]``); the peer loops in benchmarks/peers/
call ``StepClock.stamp`` from their own step ends. Nothing here imports llama_fsdp: this module
must keep working while the framework is restructured.
"""
from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path
from typing import Any, TextIO

CLOCK_ENV = "BENCH_STEP_CLOCK"
# Where the step's time goes: with $BENCH_PROFILE set (a JSON file), rank 0 runs torch.profiler
# over the steps $BENCH_PROFILE_STEPS ("first:last", default 8:10, after the warm-up) and writes
# the ops with the most self time on the device (the CPU on a CPU run), for every runner alike.
PROFILE_ENV, PROFILE_STEPS_ENV = "BENCH_PROFILE", "BENCH_PROFILE_STEPS"
PROFILE_STEPS = "8:10"
PROFILE_TOP = 25


class _CudaStamps:
    """Step ends on the GPU's own timeline, without a host sync per step: a CUDA event is
    recorded at each step end and turned into wall time once it has completed, as
    ``t0 + elapsed_time(first event, event)``, where t0 is the wall time of the first event,
    taken after one synchronize. A host sync every step would leave the GPU idle while the host
    queues the next step's first kernels, for every runner alike: a bubble that a real run does
    not have. At most ``lag`` events wait (the host is never more than that many steps ahead
    of the GPU); the rest are resolved at ``close`` (atexit)."""

    def __init__(self, lag: int = 2, *, event: Any = None, synchronize: Any = None):
        self.lag, self.pending, self.first, self.t0 = lag, [], None, 0.0
        if event is None:  # the GPU's (tests give stand-ins: there is no GPU in CI)
            import torch

            event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
            synchronize = torch.cuda.synchronize
        self._event, self._synchronize = event, synchronize

    def add(self, step: int, cpu: float) -> list[dict[str, float]]:
        """Record this step's end; return the stamps now known (oldest first)."""
        event = self._event()
        if self.first is None:  # the time base: the GPU drained, then one event and the clock
            self._synchronize()
            event.record()
            event.synchronize()
            self.first, self.t0 = event, time.time()
            return [{"step": step, "t": self.t0, "cpu": cpu}]
        event.record()
        self.pending.append((step, event, cpu))
        out = []
        while self.pending and (len(self.pending) > self.lag or self.pending[0][1].query()):
            out.append(self._resolve(*self.pending.pop(0)))
        return out

    def close(self) -> list[dict[str, float]]:
        out = [self._resolve(*p) for p in self.pending]
        self.pending = []
        return out

    def _resolve(self, step: int, event: Any, cpu: float) -> dict[str, float]:
        event.synchronize()  # done already, or the oldest of more than `lag` queued steps
        return {"step": step, "t": self.t0 + self.first.elapsed_time(event) / 1e3, "cpu": cpu}


def _cuda_in_use() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


class StepClock:
    """The ``train.callbacks`` factory and the step hook in one.

    ``StepClock(rank=..., world_size=..., output_dir=...)`` is called once per rank and returns
    the hook; ``hook(state)`` stamps ``state.step``. Only rank 0 writes, and only when
    ``$BENCH_STEP_CLOCK`` is set, so the hook costs nothing elsewhere. On CUDA a stamp marks
    when the GPU finished the step (``_CudaStamps``); on the CPU, when the step returned.
    """

    def __init__(self, *, rank: int, world_size: int = 1, output_dir: str | None = None):
        path = os.environ.get(CLOCK_ENV)
        self._file: TextIO | None = (
            open(path, "a", encoding="utf-8") if rank == 0 and path else None  # noqa: SIM115
        )
        self._cuda: _CudaStamps | None = None
        profile = os.environ.get(PROFILE_ENV)
        self._profile = _Profile(profile) if rank == 0 and profile else None
        if self._file is not None:
            atexit.register(self.close)

    def __call__(self, state: Any) -> None:
        self.stamp(int(state.step))

    def stamp(self, step: int) -> None:
        """Append this step's end time (flushed at once, so a crashed run keeps its stamps)."""
        if self._profile is not None:
            self._profile.at_step_end(step)
        if self._file is None:
            return
        cpu = time.process_time()
        if self._cuda is None and _cuda_in_use():
            self._cuda = _CudaStamps()
        self._write([{"step": step, "t": time.time(), "cpu": cpu}] if self._cuda is None
                    else self._cuda.add(step, cpu))

    def close(self) -> None:
        """Write the stamps still waiting on the GPU (called at exit; safe to call twice)."""
        if self._file is not None and self._cuda is not None:
            self._write(self._cuda.close())

    def _write(self, stamps: list[dict[str, float]]) -> None:
        for stamp in stamps:
            self._file.write(json.dumps(stamp) + "\n")
        self._file.flush()


class _Profile:
    """torch.profiler from the end of step ``first - 1`` to the end of step ``last``; then the
    top ops by self device time (self CPU time on a CPU run) go to ``path`` as JSON:
    ``{"steps": n, "device": "cuda", "ops": [{"name", "self_us", "calls"}, ...],
    "total_us": ...}`` (per profiled step: ``self_us / steps``)."""

    def __init__(self, path: str):
        first, last = (int(x) for x in os.environ.get(PROFILE_STEPS_ENV, PROFILE_STEPS).split(":"))
        self.path, self.first, self.last = Path(path), first, last
        self._prof: Any = None

    def at_step_end(self, step: int) -> None:
        import torch

        if step == self.first - 1 and self._prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if _cuda_in_use():
                torch.cuda.synchronize()
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.start()
        elif step == self.last and self._prof is not None:
            cuda = _cuda_in_use()
            if cuda:
                torch.cuda.synchronize()
            self._prof.stop()
            self.path.write_text(json.dumps(profile_summary(
                self._prof.key_averages(), steps=self.last - self.first + 1, cuda=cuda)))
            self._prof = None


def profile_summary(events: Any, *, steps: int, cuda: bool, top: int = PROFILE_TOP) -> dict:
    """The ops of ``key_averages()`` with the most self time on the device (CUDA kernels'
    time, or the CPU's on a CPU run)."""
    def self_us(e: Any) -> float:
        if not cuda:
            return float(e.self_cpu_time_total)
        return float(e.self_device_time_total)

    rows = sorted(((self_us(e), e) for e in events), key=lambda r: r[0], reverse=True)
    return {"steps": steps, "device": "cuda" if cuda else "cpu",
            "total_us": sum(us for us, _ in rows),
            "ops": [{"name": e.key, "self_us": us, "calls": int(e.count)}
                    for us, e in rows[:top] if us > 0]}


def read_stamps(path: Path, key: str = "t") -> dict[int, float]:
    """Step number -> that step's ``key`` stamp from a clock file (missing file: no stamps)."""
    if not path.exists():
        return {}
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {int(r["step"]): float(r[key]) for r in rows if key in r}


def step_walls(stamps: dict[int, float], *, warmup: int) -> list[float]:
    """Seconds of every steady step: s[n] - s[n-1] for the steps after ``warmup``."""
    return [stamps[n] - stamps[n - 1] for n in sorted(stamps) if n > warmup and n - 1 in stamps]
