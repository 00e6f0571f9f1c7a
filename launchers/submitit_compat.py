"""Every use of submitit beyond its public API, in one place, for the releases it was read from.

The launchers need four things submitit does not offer publicly:

- a local job controller started in a session of its own (a terminal's Ctrl-C then reaches only
  the launcher, which decides how the ranks stop) and bound to the launcher's life (Linux's
  parent-death signal: a launcher killed with SIGKILL takes its controller with it, and the
  controller's ranks follow: launchers/rank.py). submitit's ``start_controller`` takes neither,
  so ``start_controller`` here mirrors it with both;
- the local job's controller process (to signal and stop every rank) and SLURM's job state asked
  now, not from submitit's cache (``local_controller``, ``slurm_job_done``);
- the sbatch script a run submits, with the srun line in a restart loop
  (``RestartingSlurmExecutor``), and that script without a SLURM installation, for a dry run on
  a laptop (``sbatch_text``, which SlurmLauncher.preview calls).

``check_version`` says when the installed submitit is not one of ``TESTED``.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import submitit
from submitit.local.local import LocalJob

log = logging.getLogger(__name__)

TESTED = ((1, 5),)  # submitit releases (major, minor) whose private API this module mirrors


def check_version() -> Optional[str]:
    """None when the installed submitit is a tested release, else a warning to show."""
    have = version("submitit")
    release = tuple(int(x) for x in have.split(".")[:2] if x.isdigit())
    if release in TESTED:
        return None
    return (f"submitit {have} is not a release llama_fsdp's launchers were checked against "
            f"({', '.join('.'.join(map(str, t)) for t in TESTED)}.x): local launches, stopping "
            "ranks and the sbatch script rely on its internals (launchers/submitit_compat.py)")


def _die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A preexec_fn: the child gets ``sig`` when the process that started it dies (Linux
    PR_SET_PDEATHSIG; nothing elsewhere). The child also starts a session of its own."""
    def preexec() -> None:
        os.setsid()
        set_parent_death_signal(sig)
    return preexec


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; False where that
    does not exist (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(pr_set_pdeathsig, sig, 0, 0, 0) == 0


CONTROLLER_MODULE = "llama_fsdp.launchers.controller"
EARLY_FLAG = "--early"  # the controller's argument: wait on stdin for the job it runs


def controller_env(*, tasks_per_node: int = 1, command: str = "", cuda_devices: str = "",
                   timeout_min: float = 5.0, signal_delay_s: int = 30,
                   stderr_to_stdout: bool = False, setup: Sequence[str] = ()) -> dict[str, str]:
    """The variables submitit.local.local.start_controller (1.5.x) gives its controller."""
    return dict(
        SUBMITIT_LOCAL_NTASKS=str(tasks_per_node),
        SUBMITIT_LOCAL_COMMAND=command,
        SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * timeout_min)),
        SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(signal_delay_s)),
        SUBMITIT_LOCAL_NODEID="0",
        SUBMITIT_LOCAL_JOB_NUM_NODES="1",
        SUBMITIT_STDERR_TO_STDOUT="1" if stderr_to_stdout else "",
        SUBMITIT_EXECUTOR="local",
        CUDA_VISIBLE_DEVICES=cuda_devices,
        SUBMITIT_LOCAL_WITH_SHELL="1" if setup else "",
    )


LATE_KEYS = frozenset(controller_env())  # what only the job's submission decides
# variables the launcher may set while it prepares the job that nothing the controller imports
# reads at import (MLflow's client settings: the ranks never import MLflow under a launcher
# that ships tracking; llama_fsdp's own, read when used)
LATE_PREFIXES = ("MLFLOW_", "LLAMA_FSDP_")


class EarlyController:
    """The job's controller interpreter, started while the job is still being prepared: it
    imports the ranks' module ($LLAMA_FSDP_PRELOAD, launchers/forked.py) meanwhile, on another
    core, then waits on its stdin for the job (``go``). Started in a session of its own and
    killed when this process dies, as ``start_controller``'s; the job's variables (LATE_KEYS,
    LATE_PREFIXES) arrive with the job, and every other variable must be what it was started
    with, else the job gets a new controller (a value read at import would be stale)."""

    def __init__(self, folder: Path, env: Optional[dict[str, str]] = None):
        self.folder, self.env = Path(folder), dict(os.environ if env is None else env)
        self.process: Optional[subprocess.Popen] = subprocess.Popen(
            [sys.executable, "-m", CONTROLLER_MODULE, EARLY_FLAG, str(self.folder)],
            env=self.env, stdin=subprocess.PIPE, preexec_fn=_die_with_parent())

    def go(self, folder: Path, env: dict[str, str]) -> Optional[subprocess.Popen]:
        """The controller, told to run the job in ``folder`` (the one it was started for) with
        ``env``; None when it cannot (used already, ended, started for another folder or with
        other values of the environment)."""
        process, self.process = self.process, None
        if process is None:
            return None
        stale = sorted(k for k in set(env) | set(self.env) if k not in LATE_KEYS
                       and not k.startswith(LATE_PREFIXES) and env.get(k) != self.env.get(k))
        try:
            if stale or process.poll() is not None or Path(folder) != self.folder:
                raise OSError(f"started with other values of {', '.join(stale)}" if stale
                              else f"it exited {process.returncode}" if process.returncode
                              is not None else f"started for {self.folder}, not {folder}")
            process.stdin.write((json.dumps({"env": env}) + "\n").encode())
            process.stdin.close()
        except OSError as e:
            log.debug("the early controller is not used (%s): starting another", e)
            self._end(process)
            return None
        return process

    def cancel(self) -> None:
        """No job for it (the run failed to prepare, or had nothing to train)."""
        process, self.process = self.process, None
        if process is not None:
            self._end(process)

    @staticmethod
    def _end(process: subprocess.Popen) -> None:
        try:
            process.stdin.close()  # end of its stdin: it exits without a job
        except OSError:
            pass
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def start_controller(folder: Path, command: str, *, tasks_per_node: int = 1,
                     cuda_devices: str = "", timeout_min: float = 5.0,
                     signal_delay_s: int = 30, stderr_to_stdout: bool = False,
                     setup: Sequence[str] = (),
                     early: Optional[EarlyController] = None) -> subprocess.Popen:
    """submitit.local.local.start_controller (1.5.x: the same environment; the controller is
    submitit's, subclassed in launchers/controller.py), started in a session of its own and
    killed when this process dies; ``early``'s, when it was started for this job."""
    env = dict(os.environ)
    env.update(controller_env(
        tasks_per_node=tasks_per_node, command=command, cuda_devices=cuda_devices,
        timeout_min=timeout_min, signal_delay_s=signal_delay_s,
        stderr_to_stdout=stderr_to_stdout, setup=setup))
    if early is not None and not setup and (process := early.go(folder, env)) is not None:
        return process
    # submitit's controller (submitit.local._local), with reports for supervisors that die
    cmd: Any = [sys.executable, "-m", CONTROLLER_MODULE, str(folder)]
    if setup:
        cmd = " && ".join([*setup, shlex.join(cmd)])
    return subprocess.Popen(cmd, shell=bool(setup), env=env, preexec_fn=_die_with_parent())


class SessionLocalExecutor(submitit.LocalExecutor):
    """submitit's local executor whose controller has a session of its own and dies with the
    launcher (``start_controller``), and is the ``early`` one where that was started."""

    def __init__(self, *args: Any, early: Optional[EarlyController] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.early = early

    def _submit_command(self, command: str) -> LocalJob:
        p = self.parameters
        n_gpus, visible = p.get("gpus_per_node", 0), p.get("visible_gpus", ())
        gpus = range(n_gpus) if visible == () else visible[:n_gpus]
        ntasks = p.get("tasks_per_node", 1)
        process = start_controller(
            self.folder, command, tasks_per_node=ntasks,
            cuda_devices=",".join(str(k) for k in gpus), timeout_min=p.get("timeout_min", 2.0),
            signal_delay_s=p.get("signal_delay_s", 30),
            stderr_to_stdout=p.get("stderr_to_stdout", False), setup=p.get("setup", ()),
            early=self.early)
        return LocalJob(folder=self.folder, job_id=str(process.pid), process=process,
                        tasks=list(range(ntasks)))


def local_controller(job: Any) -> Optional[subprocess.Popen]:
    """The controller process of a local job (None for a SLURM job)."""
    return getattr(job, "_process", None)


def slurm_job_done(job: Any) -> bool:
    """Whether SLURM says the job is over, asked now (submitit caches the state otherwise)."""
    return job.watcher.is_done(job.job_id, mode="force")


def restarting_slurm_executor(restarts: int, rewrite: Callable[[str, int], str],
                              preview: bool = False) -> type:
    """A SlurmExecutor class whose sbatch script passes through ``rewrite(script, restarts)``
    (the srun line in a restart loop). ``preview``: one that needs no SLURM installation, only
    to write the script (submitit refuses to build an executor where srun is missing)."""

    class RestartingSlurmExecutor(submitit.SlurmExecutor):
        def _make_submission_file_text(self, command: str, uid: str) -> str:
            text = super()._make_submission_file_text(command, uid)
            return rewrite(text, restarts) if restarts else text

        if preview:
            @classmethod
            def affinity(cls) -> int:
                return 1

    return RestartingSlurmExecutor


def sbatch_text(executor: Any) -> str:
    """The sbatch script ``executor`` would submit for one job."""
    return executor._make_submission_file_text(executor._submitit_command_str, "preview")
