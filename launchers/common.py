"""What the local and SLURM launchers share: the rank environment, watching a job, failure
reports, stopping a job, and what the launcher does with the signals it receives.

Launchers know the RunSpec and are handed the worker's entry point; they know nothing of
training.
"""
from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

from ..config.rundir import RunDir, private_dir
from .process import Entry
from .rank import RankEntry, format_report, read_reports
from .submitit_compat import local_controller, slurm_job_done

if TYPE_CHECKING:
    from ..run.spec import RunSpec

log = logging.getLogger(__name__)

REPORT_GRACE_S = 1.5  # after the first report, how long the other ranks' reports may take


class LaunchError(RuntimeError):
    """The job failed; the message leads with the rank that failed first."""


class RankFailure(LaunchError):
    """One attempt failed: its rank reports, cause first."""

    def __init__(self, job_id: str, reports: list[dict[str, Any]]):
        self.reports = reports
        super().__init__(failure_message(job_id, reports))


class Interrupted(LaunchError):
    """The launcher was stopped by a signal; ``exit_code`` is the shell's 128 + signal."""

    def __init__(self, signum: int, message: str):
        self.exit_code = 128 + signum
        super().__init__(message)


def entry_ref(entry: Entry) -> str:
    """A module-level function as "module:qualname": the rank supervisor passes it on unread."""
    return entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}"


def rank_entry(spec: RunSpec, entry: Entry, **kw: Any) -> RankEntry:
    """The task submitit pickles into the run's submitit/ folder (and each rank into launch/):
    both folders are the user's alone (rundir.private_dir)."""
    run = RunDir(spec.output_dir)
    private_dir(run.submitit)
    private_dir(run.launch)
    return RankEntry(pickle.dumps((entry_ref(entry), spec)), **kw)


def failure_message(job_id: str, reports: list[dict[str, Any]]) -> str:
    """The cause (the earliest rank to fail that was not echoing another) first, then one line
    per rank that failed after it."""
    first, rest = reports[0], reports[1:]
    lines = [f"job {job_id} failed; the first rank to fail:", format_report(first)]
    for r in rest:
        last = (r.get("traceback") or "").strip().splitlines()[-1:] or [
            f"signal {r['signal_name']}" if r.get("signal") else f"exit code {r['exitcode']}"]
        lines.append(f"  then rank {r['rank']} on {r['host']}: {last[0]}")
    return "\n".join(lines)


# glibc malloc for CPU ranks: keep up to 256 MiB of freed heap for the next step and mmap only
# buffers over 32 MiB, instead of giving pages back to the kernel and faulting them in again
# every step (about 90% fewer page faults: benchmarks/cpu_runtime.md). Both or neither: a fixed
# trim threshold alone also pins the mmap threshold at 128 KiB. Not set when the user chose an
# allocator or glibc malloc settings (``_user_malloc``).
CPU_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
_PRELOADED_ALLOCATORS = ("malloc", "hoard")  # jemalloc, tcmalloc, mimalloc, snmalloc, ...


def _user_malloc(environ: Mapping[str, str]) -> bool:
    """Whether the environment already configures the allocator (a preloaded one, glibc malloc
    variables or tunables): then it is the user's, and left alone."""
    preload = environ.get("LD_PRELOAD", "").lower()
    return (any(k.startswith("MALLOC_") for k in environ)
            or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")
            or any(a in preload for a in _PRELOADED_ALLOCATORS))


def worker_env(output_dir: str, device: str,
               environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """Environment every rank gets: quiet tokenizers, no hub access (the driver fetched what
    the ranks need), NCCL's flight recorder dumping the last collectives of a hung rank, and on
    CPU the malloc settings above (unless ``environ``, the launching one by default, has its
    own)."""
    trace = RunDir(output_dir).nccl_trace_prefix
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
           "TORCH_FR_DUMP_TEMP_FILE": trace}
    if device == "cpu":
        if _user_malloc(os.environ if environ is None else environ):
            log.info("CPU ranks keep the allocator settings of this environment (LD_PRELOAD, "
                     "MALLOC_*, GLIBC_TUNABLES) instead of llama_fsdp's %s", CPU_MALLOC_ENV)
        else:
            env.update(CPU_MALLOC_ENV)
    return env


@contextmanager
def scoped_environ(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in os.environ while the block runs (processes started in it inherit them),
    the launching process's own values back after it: a CPU run's settings must not reach a
    later run's ranks, nor look like the user's own to it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def skip_final_collection() -> None:
    """Call last in a process that imported torch, transformers and mlflow: moves every object
    to the permanent generation, so the interpreter's collections at exit skip the ~500k
    objects those imports leave, which every rank and the launcher paid after the run had
    finished (benchmarks/cpu_runtime.md). atexit handlers, buffered files and module teardown
    still run; only cyclic garbage left at exit goes to the OS uncollected."""
    gc.freeze()


def free_port() -> int:
    """A TCP port free on this host right now (the local rendezvous port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def watch(job: Any, output_dir: str, *, max_restarts: int = 0, restarts_inside: bool = False,
          poll_s: float = 0.5, timeout_s: Optional[float] = None) -> list[Any]:
    """Wait for a submitit job; when a rank fails, stop every rank and raise RankFailure.

    A rank's supervisor leaves its report before the other ranks notice anything; they would
    then wait in a collective, so the job is stopped at once. With ``restarts_inside`` (SLURM,
    whose batch script restarts the ranks itself) an attempt that may still be restarted is
    logged and the watch goes on.
    """
    job_id = str(job.job_id).split("_")[0]
    start, seen = time.monotonic(), set()
    while not _finished(job, restarts_inside):
        for d in attempt_dirs(output_dir, job_id):
            if d.name in seen or not read_reports(d):
                continue
            time.sleep(REPORT_GRACE_S)  # let the other ranks' reports land too
            reports, seen = read_reports(d), seen | {d.name}
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
