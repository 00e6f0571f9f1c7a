"""Stopping a job's ranks: a signal to every one of them, or every one stopped at once, and what
the launcher does with the signals it receives while a job runs (``SignalGuard``)."""
from __future__ import annotations

import logging
import signal
import subprocess
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from .errors import Interrupted, StoppedBeforeLaunch
from .submitit_compat import local_controller

log = logging.getLogger(__name__)


def _descendants(pid: int) -> list[Any]:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def signal_ranks(job: Any, signum: int) -> None:
    """Send a signal to every process of a job (its rank supervisors forward it to the
    workers): submitit-local's controller's descendants, or scancel --signal on SLURM."""
    proc = local_controller(job)
    if proc is None:
        subprocess.run(["scancel", f"--signal={signal.Signals(signum).name[3:]}",
                        str(job.job_id)], check=False, capture_output=True)
        return
    for p in _descendants(proc.pid):
        try:
            p.send_signal(signum)
        except Exception:  # noqa: BLE001 - already gone
            pass


def stop_job(job: Any) -> None:
    """Stop every rank of a job now: SIGKILL to submitit-local's controller and all its
    descendants (the rank supervisors and workers), or scancel on SLURM."""
    proc = local_controller(job)
    if proc is None:
        job.cancel(check=False)
        return
    for p in [*_descendants(proc.pid)]:
        try:
            p.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass
    try:
        proc.kill()
        proc.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass


@contextmanager
def preparing() -> Iterator[None]:
    """While the job is prepared (data, store, weights): Ctrl-C, SIGTERM or SIGHUP stop it with
    Interrupted (one line, and the launch's own files removed by the command line), instead of a
    traceback from wherever it was, or a kill that leaves the run directory's owner files."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: Any) -> None:
        raise StoppedBeforeLaunch(signum, f"stopped by {signal.Signals(signum).name} while the "
                                          "job was being prepared: nothing was launched")

    previous = {sig: signal.signal(sig, stop) for sig in SignalGuard.SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def shielded(note: str) -> Iterator[None]:
    """Closing the run's tracking after a stop: further Ctrl-Cs (a third, impatient one) and
    SIGTERM wait until it is done, which its deadline bounds, so the MLflow run is closed
    instead of left RUNNING with a traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    told = []

    def wait(signum: int, _frame: Any) -> None:
        if not told:
            told.append(signum)
            log.warning("%s (%s ignored meanwhile)", note, signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, wait) for sig in SignalGuard.SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class SignalGuard:
    """While a job runs: a first SIGINT asks the ranks to save and stop at their next log step;
    a second SIGINT, or SIGTERM / SIGHUP, stops every rank at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, saving: bool):
        self.saving = saving
        self.job: Any = None
        self.interrupts = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "SignalGuard":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.job is None:
            raise Interrupted(signum, f"stopped by {signal.Signals(signum).name} before launch")
        if signum == signal.SIGINT and self.interrupts == 0:
            self.interrupts += 1
            log.warning("Ctrl-C: the ranks stop at their next log step%s (Ctrl-C again to stop "
                        "at once)", ", after saving a checkpoint" if self.saving else "")
            signal_ranks(self.job, signal.SIGINT)
            return
        stop_job(self.job)
        raise Interrupted(signum, f"stopped by {signal.Signals(signum).name}: every rank of job "
                                  f"{self.job.job_id} was stopped")

