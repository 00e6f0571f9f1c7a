"""Watching a submitted job: rank 0's log on this terminal, and its ranks' reports, so that the
first rank to fail stops every rank at once and is named (``watch``); on SLURM, what SLURM says
of the job (``Requeues``), so that a job it requeued is waited for, never cancelled."""
from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ..config.rundir import RunDir
from .errors import LaunchError, RankFailure, failure_message
from .rank import format_report, read_reports
from .signals import stop_job
from .slurm_state import JobState
from .submitit_compat import local_controller, slurm_job_done

log = logging.getLogger(__name__)


REPORT_GRACE_S = 1.5  # after the first report, how long the other ranks' reports may take


class LogStreamer(threading.Thread):
    """Copy new bytes of rank 0's stdout/stderr files to this terminal while the job runs."""

    def __init__(self, paths: list[tuple[Path, Any]], interval: float = 0.3):
        super().__init__(daemon=True)
        self.paths, self.interval = paths, interval
        self.offsets = {p: 0 for p, _ in paths}
        self._halt = threading.Event()

    def pump(self) -> None:
        for path, sink in self.paths:
            if not path.exists():
                continue
            with path.open("rb") as f:
                f.seek(self.offsets[path])
                chunk = f.read()
            if chunk:
                self.offsets[path] += len(chunk)
                if hasattr(sink, "buffer"):  # raw bytes keep tqdm's carriage returns intact
                    sink.buffer.write(chunk)
                else:
                    sink.write(chunk.decode(errors="replace"))
                sink.flush()

    def run(self) -> None:
        while not self._halt.is_set():
            self.pump()
            self._halt.wait(self.interval)
        self.pump()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


@contextmanager
def streaming(job: Any, enabled: bool) -> Iterator[None]:
    """Rank 0's log on this terminal while the block runs."""
    if not enabled:
        yield
        return
    paths = job.paths if not hasattr(job, "task") else job.task(0).paths
    streamer = LogStreamer([(Path(paths.stdout), sys.stdout), (Path(paths.stderr), sys.stderr)])
    streamer.start()
    try:
        yield
    finally:
        streamer.stop()


def attempt_dirs(output_dir: str, job_id: str) -> list[Path]:
    """This job's per-attempt report folders, in order (requeue, attempt)."""
    root = RunDir(output_dir).launch
    found = [p for p in root.glob(f"{job_id}.*.*") if p.is_dir()]
    return sorted(found, key=lambda p: tuple(int(x) for x in p.name.split(".")[1:]))


class Requeues:
    """SLURM's word on a job while the launcher watches it: a requeue (a preemption, an admin's
    ``scontrol requeue``, a failed node) is said once, and a failed attempt of a requeued job
    is no failure of the job."""

    EVERY_S = 10.0  # SLURM's controller is asked this often while nothing else asks it

    def __init__(self, job_id: str, ask: Callable[[], Optional[JobState]]):
        self.job_id, self.ask = job_id, ask
        self.restarts, self.preempting, self.waiting = 0, False, False
        self.asked_at, self.state = -self.EVERY_S, None

    def poll(self, now: bool = False) -> Optional[JobState]:
        """Ask SLURM (at most every EVERY_S, unless ``now``); say what changed: selected for
        preemption, requeued, running again."""
        if not now and time.monotonic() - self.asked_at < self.EVERY_S:
            return self.state
        self.asked_at, self.state = time.monotonic(), self.ask()
        state = self.state
        if state is None:
            return None
        if state.preempting and not self.preempting:
            log.warning("SLURM preempts job %s: its ranks save a checkpoint at their next log "
                        "step, if the partition's grace time allows, and the job is requeued",
                        self.job_id)
        self.preempting = state.preempting
        if state.restarts > self.restarts:
            self.restarts, self.waiting = state.restarts, True
            log.warning("job %s was requeued by SLURM (restart %d: a preemption, an admin's "
                        "scontrol requeue or a failed node): its ranks were stopped, and it runs "
                        "again from its newest checkpoint when SLURM starts it. Waiting for it",
                        self.job_id, state.restarts)
        elif self.waiting and state.state == "RUNNING":
            self.waiting = False
            log.info("job %s runs again (restart %d)", self.job_id, state.restarts)
        return state

    def stopped_by_slurm(self, attempt: Path) -> bool:
        """Whether an attempt's failed ranks were stopped by SLURM taking the job back (its
        restart count passed the attempt's, or its grace time runs), not by a failure."""
        state = self.poll(now=True)
        requeue = int(attempt.name.split(".")[1])
        return state is not None and (state.requeued(requeue) or state.preempting)


def watch(job: Any, output_dir: str, *, max_restarts: int = 0, restarts_inside: bool = False,
          poll_s: float = 0.5, timeout_s: Optional[float] = None,
          requeues: Optional[Requeues] = None) -> list[Any]:
    """Wait for a submitit job; when a rank fails, stop every rank and raise RankFailure.

    A rank's supervisor leaves its report before the other ranks notice anything; they would
    then wait in a collective, so the job is stopped at once. With ``restarts_inside`` (SLURM,
    whose batch script restarts the ranks itself) an attempt that may still be restarted is
    logged and the watch goes on. With ``requeues`` (SLURM), ranks stopped because SLURM took
    the job back into its queue are no failure: the requeue is said, and the watch goes on.
    """
    job_id = str(job.job_id).split("_")[0]
    start, seen = time.monotonic(), set()
    while not _finished(job, restarts_inside):
        if requeues is not None:
            requeues.poll()
        for d in attempt_dirs(output_dir, job_id):
            if d.name in seen or not read_reports(d):
                continue
            time.sleep(REPORT_GRACE_S)  # let the other ranks' reports land too
            reports, seen = read_reports(d), seen | {d.name}
            if requeues is not None and requeues.stopped_by_slurm(d):
                log.info("job %s's ranks were stopped by SLURM taking the job back (%s): %s",
                         job_id, d.name, format_report(reports[0]).splitlines()[0])
                continue
            if restarts_inside and reports[0]["attempt"] < max_restarts:
                log.warning("%s\nthe job restarts its ranks from the newest checkpoint "
                            "(restart %d of %d)", failure_message(job_id, reports),
                            reports[0]["attempt"] + 1, max_restarts)
                continue
            stop_job(job)
            raise RankFailure(job_id, reports)
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            stop_job(job)
            raise LaunchError(f"job {job_id} exceeded {timeout_s:.0f}s and was cancelled")
        time.sleep(poll_s)
    dirs = attempt_dirs(output_dir, job_id)
    last = read_reports(dirs[-1]) if dirs and dirs[-1].name not in seen else []
    if last:
        raise RankFailure(job_id, last)
    controller = local_controller(job)
    if controller is not None and (code := controller.poll()) is not None and code < 0:
        raise LaunchError(f"job {job_id}'s controller (pid {controller.pid} on "
                          f"{socket.gethostname()}) was killed by signal {-code} "
                          f"({signal.Signals(-code).name}); its ranks went with it")
    try:
        return job.results()
    except Exception as e:  # submitit raises with the task's traceback or the job state
        raise LaunchError(f"job {job_id} failed: {e}") from e


def _finished(job: Any, restarts_inside: bool) -> bool:
    """Whether the job is over. When the batch script restarts ranks itself, a failed attempt
    leaves every task's result file behind (which submitit reads as done): ask SLURM."""
    if restarts_inside:
        return slurm_job_done(job)
    return job.done()

