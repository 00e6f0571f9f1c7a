"""One rank: a light supervisor (the submitit task) and the worker it runs as a child process.

submitit starts one task per rank, locally or through srun. The task does not train itself: it
starts the worker in a child process and waits for it, so that however the worker ends -- an
exception, an exit code, a signal such as the OOM killer's SIGKILL -- a report naming the rank,
host, exit code or signal and the last lines of its log is left where the launcher looks
(``<run>/launch/<job>.<requeue>.<attempt>/rank<r>.json``). A supervisor that srun or torchrun
starts never imports torch: it starts in a fraction of a second and stays small next to the
worker, which it starts as a new interpreter. A local one is forked from the controller, which
imported the worker's modules once, and forks its worker in turn (launchers/forked.py).

Signals: SIGUSR2 (SLURM's --signal, before the time limit) and SIGINT (the launcher's forward of
a user's Ctrl-C) go on to the worker, which saves and stops at its next log step
(llama_fsdp/train/stopping.py); so does SIGTERM under SLURM, which sends it before it stops a
job (a preemption, a requeue, a cancel). After SIGUSR2, rank 0's supervisor hands over to
submitit, which requeues the job; after SIGTERM it asks SLURM (launchers/slurm_state.py): a job
SLURM requeued, or one it preempts (requeued now, through submitit), waits in the queue, and its
MLflow run says so. The requeued job resumes from the newest checkpoint.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from . import forked
from .proctitle import set_title
from .worker_process import main as child_main  # the worker, forked
from ..config.status import FAILED, PREEMPTED, mlflow_status
from ..config.rundir import RunDir, exchange_files, private_dir, report_path
from .process import Entry

if TYPE_CHECKING:
    from ..run.spec import RunSpec

ATTEMPT_ENV = "LLAMA_FSDP_ATTEMPT"  # restart number, set by the launcher (local) or sbatch loop
RUN_DIR_ENV = "LLAMA_FSDP_RUN_DIR"  # the run directory, for the local controller's reports
CHILD_MODULE = "llama_fsdp.launchers.worker_process"  # what the supervisor runs as the worker process
# Errors a rank raises because another rank went away first: reported after the cause.
ECHO_ERRORS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
          "communicator was aborted", "NCCL operations have failed or timed out",
          "Socket Timeout", "recvBytes", "sendBytes", "Connection refused")


class RankFailed(RuntimeError):
    """Raised in the supervisor when its worker failed; the report is already on disk."""


def rendezvous_port(job_id: str) -> int:
    """The job's rendezvous port, the same on every node: from its id and attempt, below
    Linux's ephemeral range (32768-60999), where submitit's own choice (20000-60000) can meet a
    port the node already uses for an outgoing connection (EADDRINUSE when jobs share a node)."""
    base = int(str(job_id).split("_")[0]) * 7 % 12000
    return 20000 + (base + int(os.environ.get(ATTEMPT_ENV, "0"))) % 12000


def attempt_dir(output_dir: str | Path, job_id: str, requeue: int, attempt: int) -> Path:
    return RunDir(output_dir).attempt(job_id, requeue, attempt)


def read_reports(directory: Path) -> list[dict[str, Any]]:
    """The rank reports of one attempt, cause first: the earliest non-echo failure, then the
    rest by time."""
    out = []
    for p in directory.glob(report_path(Path(), "*").name):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # being written: read again on the next poll
    return sorted(out, key=lambda r: (r["echo"], r["time"]))


def format_report(r: dict[str, Any]) -> str:
    """One rank's report as a user reads it."""
    how = (f"killed by signal {r['signal']} ({r['signal_name']})" if r.get("signal")
           else f"exit code {r['exitcode']}")
    if r.get("signal") == signal.SIGKILL:
        how += ": the kernel's OOM killer sends this when memory runs out (see dmesg), or "\
               "someone ran kill -9"
    who = (f"rank {r['rank']}'s supervisor" if r.get("process") == "supervisor"
           else f"rank {r['rank']}")
    lines = [f"{who} on {r['host']} (pid {r['pid']}): {how}"]
    if r.get("process") == "supervisor":
        lines.append("the rank's supervisor process died without reporting, and its training "
                     "process with it (it dies with its parent)")
    if r.get("traceback"):
        lines.append(r["traceback"].rstrip())
    if r.get("log_tail"):
        lines.append("last log lines:\n" + "\n".join("  " + x for x in r["log_tail"]))
    return "\n".join(lines)


@dataclass
class RankEntry:
    """The picklable submitit task: export the rank environment, run the worker as a child.

    ``payload`` is the pickled (entry point, RunSpec): the supervisor hands it to the child
    unread, so it never imports what the worker imports.
    """

    payload: bytes
    master_addr: Optional[str] = None  # None: the first node of the job
    master_port: Optional[int] = None  # None: derived from the job id (same on every node)
    # a launcher waits for the job and closes its tracking after it (Launcher.waits); else rank
    # 0's supervisor closes a failed run, and ends its sweep point
    watched: bool = True

    def __call__(self) -> Any:
        import submitit
        from submitit.helpers import TorchDistributedEnvironment

        from .submitit_compat import set_parent_death_signal

        # the supervisor goes when what started it goes (the local controller, srun's step):
        # a killed launcher leaves no rank behind
        set_parent_death_signal(signal.SIGKILL)

        dist_env = TorchDistributedEnvironment()
        job = submitit.JobEnvironment()
        dist_env.master_port = self.master_port or rendezvous_port(job.job_id)
        if self.master_addr is not None:
            dist_env.master_addr = self.master_addr
        dist_env.export(set_cuda_visible_devices=False, overwrite=True)
        return Supervisor(self.payload, job.job_id.split("_")[0], dist_env.rank,
                          [Path(job.paths.stderr), Path(job.paths.stdout)],
                          watched=self.watched).run()

    def checkpoint(self) -> Any:
        """submitit calls this on rank 0 to requeue after a preemption: the same task again
        (the requeued job sees SLURM_RESTART_COUNT > 0 and resumes from its checkpoints)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self)


class Supervisor:
    """Runs the worker child, forwards stop signals, reports how the child ended."""

    def __init__(self, payload: bytes, job_id: str, rank: int, logs: list[Path], *,
                 watched: bool = True):
        self.payload, self.job_id, self.rank, self.logs = payload, job_id, rank, logs
        self.watched = watched
        self.attempt = int(os.environ.get(ATTEMPT_ENV, "0"))
        self.requeue = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        self.child: Optional[subprocess.Popen | forked.Forked] = None
        self._submitit_usr2: Any = None
        self.signals: set[int] = set()  # the stop signals this rank received
        self.spec: Any = None

    def run(self) -> Any:
        entry, spec = pickle.loads(self.payload)
        if hasattr(spec, "world_size"):  # a RunSpec (an entry point may take anything)
            set_title(self.rank, spec.world_size, "supervisor", spec.output_dir)
        if self.attempt or self.requeue:  # a restart or a requeue continues the checkpoints
            spec = replace(spec, resume="auto", restart=self.attempt + self.requeue)
        self.spec = spec
        where = attempt_dir(spec.output_dir, self.job_id, self.requeue, self.attempt)
        where.mkdir(parents=True, exist_ok=True)
        files = exchange_files(where, self.rank)
        for f in files.values():
            f.unlink(missing_ok=True)
        files["in"].write_bytes(pickle.dumps((entry, spec)))
        self._install_signals(warned=_stop_warning(spec))
        args = [str(files[k]) for k in ("in", "out", "traceback")]
        if forked.preloaded():  # the local controller imported the worker's modules once
            self.child = forked.fork(lambda: child_main(*args), before=_dies_with_parent)
        else:
            self.child = subprocess.Popen([sys.executable, "-u", "-m", CHILD_MODULE, *args],
                                          preexec_fn=_dies_with_parent)
        code = self._wait()
        files["in"].unlink(missing_ok=True)
        unwatched = self.rank == 0 and not self.watched  # no launcher waits for the job
        if code == 0 and files["out"].exists():
            result = pickle.loads(files["out"].read_bytes())
            files["out"].unlink()
            preempted = getattr(result, "status", None) == PREEMPTED
            if (not preempted or not self._after_preemption(spec)) and unwatched:
                _point_ended(spec)  # (a requeued point has not ended)
            return result
        report = self._report(code, files["traceback"])
        report_path(where, self.rank).write_text(json.dumps(report, indent=1))
        if self.rank == 0 and _stop_warning(spec) and self._taken_back(spec):
            raise RankFailed(format_report(report))  # the job runs again: it has not failed
        if unwatched and self.attempt >= spec.cluster.max_restarts:
            _close_mlflow_run(spec)  # no launcher waits to do it
            _point_ended(spec)
        raise RankFailed(format_report(report))

    def _install_signals(self, warned: bool) -> None:
        """SIGUSR2 (SLURM's --signal) and SIGINT (a user's stop, forwarded by the launcher) go on
        to the worker; so does SIGTERM where it warns of a stop (SLURM: a preemption, a requeue,
        a cancel): rank 0 then asks SLURM whether the job was requeued."""
        self._submitit_usr2 = signal.getsignal(signal.SIGUSR2)
        for sig in (signal.SIGUSR2, signal.SIGINT, *((signal.SIGTERM,) if warned else ())):
            signal.signal(sig, self._forward)

    def _forward(self, signum: int, _frame: Any) -> None:
        first_term = signum == signal.SIGTERM and signum not in self.signals
        self.signals.add(signum)
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)
        if first_term and self.rank == 0:
            # SIGKILL may follow before the worker is done: say now what SLURM says already
            threading.Thread(target=self._say_if_requeued, daemon=True).start()

    def _say_if_requeued(self) -> None:
        from .slurm_state import job_state

        state = job_state(self.job_id)
        if state is not None and state.requeued(self.requeue):
            _mark_requeued(self.spec, wait_for_lock=False)

    def _wait(self) -> int:
        while True:
            try:
                return self.child.wait()  # type: ignore[union-attr]
            except InterruptedError:
                continue

    def _after_preemption(self, spec: RunSpec) -> bool:
        """The worker stopped on a preemption's signal; whether the job goes on (requeued).
        SIGUSR2 (SLURM's warning before the time limit, or a preemption's with
        send_user_signal): rank 0 hands over to submitit, which requeues the job and exits.
        SIGTERM: rank 0 asks SLURM (``_taken_back``)."""
        if signal.SIGUSR2 in self.signals or not _stop_warning(spec):
            self._hand_over_to_submitit(signal.SIGUSR2)
            return True
        return self.rank != 0 or self._taken_back(spec)

    def _taken_back(self, spec: RunSpec) -> bool:
        """Rank 0, after SLURM's SIGTERM or a failed worker: whether SLURM takes the job back
        into its queue. Requeued already (an admin's requeue, a preemption's grace time over, a
        failed node): the MLflow run says it waits. Preempted, its grace time running: the job
        is requeued now through submitit (a job whose ranks end within the grace time is over,
        COMPLETED, never requeued). Else (cancelled, or a stray signal): False."""
        from .slurm_state import job_state

        state = job_state(self.job_id)
        if state is None:
            return False
        if state.requeued(self.requeue):
            _mark_requeued(spec)
            return True
        if state.preempting:
            self._hand_over_to_submitit(signal.SIGTERM)
            return True
        return False

    def _hand_over_to_submitit(self, signum: int) -> None:
        """Rank 0 asks submitit to requeue (it calls checkpoint(), requeues the job and exits:
        the MLflow run then says it waits); others return."""
        if not callable(self._submitit_usr2):
            return
        try:
            self._submitit_usr2(signum, None)
        except SystemExit:
            if self.rank == 0:
                _mark_requeued(self.spec)
            raise

    def _report(self, code: int, tb_file: Path) -> dict[str, Any]:
        tb = json.loads(tb_file.read_text()) if tb_file.exists() else {}
        sig = -code if code < 0 else 0
        text = tb.get("traceback", "")
        return {"rank": self.rank, "host": socket.gethostname(), "pid": self.child.pid,  # type: ignore[union-attr]
                "exitcode": code, "signal": sig,
                "signal_name": signal.Signals(sig).name if sig else None,
                "time": tb.get("time", time.time()), "traceback": text,
                "echo": any(e in text for e in ECHO_ERRORS), "attempt": self.attempt,
                "log_tail": _tail(self.logs, 12)}


def _stop_warning(spec: RunSpec) -> bool:
    """Whether SIGTERM warns of a stop where this rank runs (the launcher's placement: SLURM)."""
    return spec.placement is not None and spec.placement.stop_warning_s is not None


def _dies_with_parent() -> None:
    """The worker's preexec_fn: SIGKILL when its supervisor dies (Linux), so a supervisor
    killed by anything leaves no training process running on its own."""
    from .submitit_compat import set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL)


def _mark_requeued(spec: Optional[RunSpec], *, wait_for_lock: bool = True) -> None:
    """The MLflow run waits in SLURM's queue again (its job was requeued): its status says
    so instead of failed or stopped, until the job runs again."""
    if spec is None or not spec.tracking.enabled:
        return
    try:
        from llama_fsdp.tracking import Spool, deliver_pending, events

        Spool(spec.output_dir).append(events.Waiting())
        deliver_pending(spec.output_dir, deadline_s=min(5.0, spec.tracking.final_delivery_s),
                        wait_for_lock=wait_for_lock)
    except Exception as e:  # noqa: BLE001 - the job is requeued whatever MLflow shows
        print(f"could not mark the MLflow run requeued: {e}", file=sys.stderr)


def _close_mlflow_run(spec: RunSpec) -> None:
    """Mark the run FAILED in MLflow when no launcher waits to do it (a SLURM job that
    returned at submission: launchers/base.py); what rank 0 spooled is delivered with it."""
    if not spec.tracking.enabled:
        return
    try:
        from llama_fsdp.tracking import close_run

        close_run(spec.output_dir, mlflow_status(FAILED),
                  deadline_s=spec.tracking.final_delivery_s)
    except Exception as e:  # noqa: BLE001 - the rank's own failure is what matters
        print(f"could not mark the MLflow run failed: {e}", file=sys.stderr)


def _point_ended(spec: RunSpec) -> None:
    """A sweep point no launcher waits for ended: its sweep's summary, final if it was the
    last (a single run: nothing)."""
    if spec.sweep_id is None:
        return
    try:
        from llama_fsdp.tracking.sweep import point_ended

        point_ended(spec)
    except Exception as e:  # noqa: BLE001 - the run itself is done and recorded
        print(f"could not update the summary of sweep {spec.sweep_id} ({e}): run `python -m "
              f"llama_fsdp.tracking.sweep {spec.sweep_id} --uri <tracking uri>`", file=sys.stderr)


def _tail(paths: list[Path], n: int) -> list[str]:
    lines: list[str] = []
    for p in paths:
        try:
            with p.open("rb") as f:
                f.seek(max(0, p.stat().st_size - 16384))
                text = f.read().decode(errors="replace").replace("\r", "\n")
        except OSError:
            continue
        lines += [x for x in text.splitlines() if x.strip() and not x.startswith("submitit ")][-n:]
    return lines[-n:]


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

