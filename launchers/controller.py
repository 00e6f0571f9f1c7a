"""The local job's controller: submitit's, which starts one rank supervisor per task and waits
for them, plus a report for a supervisor that died without writing its own (killed by a signal,
as SIGKILL or the OOM killer does it): the launcher then names it, stops the other ranks and
restarts from the newest checkpoint as it does for a dead training process.

    python -m llama_fsdp.launchers.controller <submitit folder>

Started by launchers/submitit_compat.start_controller (which also ties its life to the
launcher's); the run directory and attempt come from the environment the local launcher sets.
When that names the ranks' module ($LLAMA_FSDP_PRELOAD), the controller imports it once and
forks the supervisors instead of starting new interpreters (launchers/forked.py).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from submitit.core.submission import process_job
from submitit.core.utils import JobPaths
from submitit.local.local import Controller

from . import forked
from .submitit_compat import EARLY_FLAG
from .rank import ATTEMPT_ENV, RUN_DIR_ENV, attempt_dir, report_path


class ReportingController(Controller):
    """submitit's local controller; a task (rank supervisor) that ends with an error and leaves
    no report gets one written here, at once."""

    def __init__(self, folder: Path):
        super().__init__(folder)
        run_dir = os.environ.get(RUN_DIR_ENV)
        self.reports: Optional[Path] = (
            attempt_dir(run_dir, self.pid, 0, int(os.environ.get(ATTEMPT_ENV, "0")))
            if run_dir else None)
        self.reported: set[int] = set()

    def start_tasks(self) -> None:
        """submitit's, with each task forked from this process when the ranks' module is
        preloaded: the same environment, log files and exit codes as `python -u -m
        submitit.core._submit <folder>`, without the new interpreter's imports."""
        if not forked.preload():
            super().start_tasks()
            return
        self.folder.mkdir(exist_ok=True)
        paths = [JobPaths(self.folder, self.pid, k) for k in range(self.ntasks)]
        self.stdouts = [p.stdout.open("a") for p in paths]
        self.stderrs = (self.stdouts if self.stderr_to_stdout
                        else [p.stderr.open("a") for p in paths])
        for k in range(self.ntasks):
            env = {"SUBMITIT_LOCAL_LOCALID": str(k), "SUBMITIT_LOCAL_GLOBALID": str(k),
                   "SUBMITIT_LOCAL_JOB_ID": self.pid}
            self.tasks.append(forked.fork(  # type: ignore[arg-type]
                lambda: process_job(self.folder), stdout=self.stdouts[k].fileno(),
                stderr=self.stderrs[k].fileno(), env=env, before=self._close_logs_after_fork))

    def _close_logs_after_fork(self) -> None:
        """In a forked task, once its own log files are its 1 and 2: the controller's open
        log files are not its to hold (as Popen's close_fds)."""
        for f in {id(f): f for f in self.stdouts + self.stderrs}.values():
            f.close()

    def wait(self, freq: int = 24) -> Sequence[Optional[int]]:
        timeout = freq * self.timeout_s
        almost_timeout = freq * (self.timeout_s - self.signal_delay_s)
        for step in range(timeout):
            codes = [t.poll() for t in self.tasks]
            self._report_dead(codes)
            if all(c is not None for c in codes):
                return codes
            if step == almost_timeout:
                from submitit.local.local import LocalJobEnvironment

                self._forward_signal(LocalJobEnvironment._usr_sig())
            time.sleep(1.0 / freq)
        return [t.poll() for t in self.tasks]

    def _report_dead(self, codes: list[Optional[int]]) -> None:
        if self.reports is None:
            return
        for rank, code in enumerate(codes):
            if code in (None, 0) or rank in self.reported:
                continue
            self.reported.add(rank)
            path = report_path(self.reports, rank)
            if path.exists():  # the supervisor reported its worker's failure itself
                continue
            sig = -code if code < 0 else 0
            self.reports.mkdir(parents=True, exist_ok=True)
            report = {"rank": rank, "host": socket.gethostname(), "pid": self.tasks[rank].pid,
                      "exitcode": code, "signal": sig,
                      "signal_name": signal.Signals(sig).name if sig else None,
                      "time": time.time(), "traceback": "", "echo": False,
                      "attempt": int(os.environ.get(ATTEMPT_ENV, "0")), "log_tail": [],
                      "process": "supervisor"}
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(report, indent=1))
            tmp.replace(path)


def wait_for_job() -> bool:
    """An early controller (submitit_compat.EarlyController): import the ranks' module while
    the launcher prepares the job, then read from stdin the environment the job runs with;
    False when stdin ends first (no job: the launch stopped before its ranks)."""
    forked.preload()
    line = sys.stdin.readline()
    if not line.strip():
        return False
    os.environ.clear()
    os.environ.update(json.loads(line)["env"])
    return True


if __name__ == "__main__":
    usage = "python -m llama_fsdp.launchers.controller [--early] <submitit folder>"
    assert len(sys.argv) in (2, 3) and (len(sys.argv) == 2) != (sys.argv[1] == EARLY_FLAG), usage
    if len(sys.argv) == 2 or wait_for_job():
        ReportingController(Path(sys.argv[-1])).run()
