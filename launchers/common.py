"""What the local and SLURM launchers share: the per-rank entry, log streaming, failure handling.

Launchers know the RunSpec and are handed the worker's entry point as a callable; they know
nothing of training.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

Entry = Callable[[Any], Any]
ERROR_GLOB = "rank*.error"


class LaunchError(RuntimeError):
    """The job failed; the message holds the failing rank's traceback."""


@dataclass
class RankEntry:
    """Picklable per-rank callable: export the rank environment, then run the worker.

    submitit starts one process per task (rank) on every node; each reads its rank from the
    SLURM (or submitit-local) environment. No torchrun inside a task.
    """

    entry: Entry
    master_addr: Optional[str] = None  # None: the first node of the job
    master_port: Optional[int] = None  # None: derived from the job id (same on every node)

    def __call__(self, spec: Any) -> Any:
        from submitit.helpers import TorchDistributedEnvironment

        env = TorchDistributedEnvironment()
        if self.master_port is not None:
            env.master_port = self.master_port
        if self.master_addr is not None:
            env.master_addr = self.master_addr
        env.export(set_cuda_visible_devices=False, overwrite=True)
        return self.entry(spec)

    def checkpoint(self, spec: Any) -> Any:
        """submitit calls this on preemption / timeout: requeue the same spec (resume=auto)."""
        import dataclasses

        import submitit

        if dataclasses.is_dataclass(spec) and hasattr(spec, "resume"):
            spec = dataclasses.replace(spec, resume="auto")  # the requeued job continues
        return submitit.helpers.DelayedSubmission(self, spec)


def rank_errors(output_dir: str) -> list[str]:
    """Tracebacks the ranks left, earliest first: the first is the cause, the rest are usually
    its echo (peers whose collectives broke when the failing rank went away)."""
    paths = sorted(Path(output_dir).glob(ERROR_GLOB), key=lambda p: p.stat().st_mtime_ns)
    return [p.read_text() for p in paths]


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


def watch(job: Any, output_dir: str, *, stream: bool = True, poll_s: float = 0.5,
          timeout_s: Optional[float] = None) -> list[Any]:
    """Wait for a submitit job; stream rank 0's logs; on a rank's failure stop all ranks.

    A rank that raises writes its traceback (worker._report_failure) before the others notice
    anything; the others would then wait in a collective, so the job is cancelled at once and
    the failing rank's traceback is raised here instead of hanging.
    """
    streamer = None
    if stream:
        paths = job.paths if not hasattr(job, "task") else job.task(0).paths
        streamer = LogStreamer([(Path(paths.stdout), sys.stdout), (Path(paths.stderr), sys.stderr)])
        streamer.start()
    start = time.monotonic()
    try:
        while not job.done():
            errors = rank_errors(output_dir)
            if errors:
                time.sleep(1.0)  # let the other ranks' reports land too
                stop_job(job)
                raise LaunchError(_failure_message(job, rank_errors(output_dir)))
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                stop_job(job)
                raise LaunchError(f"job {job.job_id} exceeded {timeout_s:.0f}s and was cancelled")
            time.sleep(poll_s)
    finally:
        if streamer is not None:
            streamer.stop()
    errors = rank_errors(output_dir)
    if errors:
        raise LaunchError(_failure_message(job, errors))
    try:
        return job.results()
    except Exception as e:  # submitit raises with the task's traceback or the job state
        raise LaunchError(f"job {job.job_id} failed: {e}") from e


def stop_job(job: Any) -> None:
    """Stop every rank of a job now.

    A submitit-local job is a controller process whose children are the ranks: killing the
    ranks lets the controller exit normally. SLURM jobs are cancelled with scancel.
    """
    proc = getattr(job, "_process", None)
    if proc is None:
        job.cancel(check=False)
        return
    import psutil

    try:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.wait(timeout=30)
    except (psutil.NoSuchProcess, subprocess.TimeoutExpired):
        job.cancel(check=False)


def _failure_message(job: Any, errors: list[str]) -> str:
    first, rest = errors[0], errors[1:]
    more = "".join(f"\n  then {e.splitlines()[0].rstrip(':')}: {e.strip().splitlines()[-1]}"
                   for e in rest)
    return f"job {job.job_id} failed; the first failing rank's error:\n{first}{more}"


def clear_stale_errors(output_dir: str) -> None:
    """Error files from an earlier attempt of this run dir must not fail the new attempt."""
    for p in Path(output_dir).glob(ERROR_GLOB):
        p.rename(p.with_suffix(f".error.{int(time.time())}"))


def worker_env() -> dict[str, str]:
    """Environment every rank gets: one thread pool per rank, quiet tokenizers."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "TOKENIZERS_PARALLELISM": "false"}
