"""Helpers for the fault suite: the real command in a fresh directory, a real MLflow server on
loopback, the run's progress read from its tracking spool, leftover processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

import pytest

from llama_fsdp.launchers.environment import free_port
from tests import reaper
from tests.warm import python as warm_python

FAST = ["cluster.device=cpu", "eval.every_steps=0", "eval.task_prompts=0", "train.warmup_steps=1"]


def start_cli(cwd: Path, *overrides: str, env: Optional[dict] = None,
              warm: bool = False) -> subprocess.Popen:
    """`python -m llama_fsdp ...` in its own session (signals in a test reach it alone): a new
    interpreter, or with ``warm`` one forked from a warm one (tests/warm.py) where the fault is
    in the run's state (a checkpoint, a cache, the tracking store), not in how its processes
    start, end or are signalled."""
    python = warm_python() if warm else sys.executable
    return subprocess.Popen([python, "-m", "llama_fsdp", *FAST, *overrides], cwd=cwd,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def run_cli(cwd: Path, *overrides: str, env: Optional[dict] = None,
            timeout: float = 600, warm: bool = False) -> tuple[int, str, float]:
    t0 = time.monotonic()
    p = start_cli(cwd, *overrides, env=env, warm=warm)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # fail the test, and leave no run behind
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        raise AssertionError(f"still running after {timeout:.0f} s:\n{out[-3000:]}") from None
    return p.returncode, out, time.monotonic() - t0


def run_dir(cwd: Path) -> Path:
    dirs = sorted((cwd / "outputs" / "runs").glob("*/*"))
    assert len(dirs) == 1, dirs
    return dirs[0]


def logged_steps(run: Path) -> list[int]:
    """Steps whose metrics rank 0 has spooled (its record, whether MLflow answers or not)."""
    from llama_fsdp.tracking import Spool, events

    spool = run / "tracking" / "spool.jsonl"
    if not spool.exists():
        return []
    return [e.step for e in Spool(run).events()
            if isinstance(e, events.Metrics) and "loss" in e.metrics]


def logged_losses(run: Path) -> list[tuple[int, float]]:
    """(step, loss) in the order rank 0 spooled them: a restarted run logs again from the step
    after the checkpoint it resumed from."""
    from llama_fsdp.tracking import Spool, events

    return [(e.step, e.metrics["loss"]) for e in Spool(run).events()
            if isinstance(e, events.Metrics) and "loss" in e.metrics]


# the run the restart tests interrupt (with FAST): nothing in it depends on the faults' hooks,
# checkpoints or restarts, so its losses are what an interrupted one must log
UNINTERRUPTED_STEPS = 8


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    """Step -> loss of the restart tests' run, uninterrupted, through the same command."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    code, log, _ = run_cli(cwd, f"train.max_steps={UNINTERRUPTED_STEPS}", "save.every_steps=0")
    assert code == 0, log[-3000:]
    losses = logged_losses(run_dir(cwd))
    assert [s for s, _ in losses] == list(range(1, UNINTERRUPTED_STEPS + 1)), losses
    return dict(losses)


def wait_for_step(cwd: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        runs = sorted((cwd / "outputs" / "runs").glob("*/*"))
        if runs and max(logged_steps(runs[0]), default=0) >= step:
            return runs[0]
        time.sleep(0.2)
    raise TimeoutError(f"step {step} not reached in {timeout}s")


def leftovers(marker: str) -> list[str]:
    """Processes still alive whose command line or working directory mentions ``marker`` (a
    test's directory). The working directory too: a rank's process title (launchers/
    proctitle.py) replaces its command line, and names only the run directory's last part."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status", "cwd"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if ((marker in cmd or marker in (p.info["cwd"] or ""))
                and p.info["status"] != psutil.STATUS_ZOMBIE and p.pid != os.getpid()):
            out.append(f"{p.pid}: {cmd[:200]}")
    return out


def no_leftovers(marker: str, within_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + within_s
    while (left := leftovers(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


class MlflowServer:
    """`mlflow server` on loopback with its own sqlite store, stoppable like a crash (SIGKILL
    to its whole process group) and restartable on the same port and store. ``admin``: a
    (user, password) to run MLflow's basic-auth app with (it refuses any request without)."""

    def __init__(self, root: Path, *, admin: Optional[tuple[str, str]] = None):
        self.root, self.port, self.admin = root, free_port(), admin
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None

    def _auth(self) -> tuple[list[str], dict[str, str]]:
        if self.admin is None:
            return [], {}
        ini = self.root / "auth.ini"
        ini.write_text("[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
                       f"database_uri = sqlite:///{self.root}/auth.db\n"
                       f"admin_username = {self.admin[0]}\nadmin_password = {self.admin[1]}\n"
                       "authorization_function = mlflow.server.auth:"
                       "authenticate_request_basic_auth\n")
        return (["--app-name", "basic-auth"],
                {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_FLASK_SERVER_SECRET_KEY": "test"})

    def start(self, timeout: float = 90) -> "MlflowServer":
        mlflow = Path(sys.executable).with_name("mlflow")
        args, env = self._auth()
        self.proc = subprocess.Popen(
            [str(mlflow), "server", "--backend-store-uri", f"sqlite:///{self.root}/server.db",
             "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1", *args],
            cwd=self.root, stdout=subprocess.DEVNULL, stderr=(self.root / "server.log").open("a"),
            start_new_session=True, env={**os.environ, **env})
        reaper.register(self.proc.pid)  # (its session ends with this process, however it ends)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise TimeoutError("mlflow server did not come up:\n" +
                           (self.root / "server.log").read_text()[-2000:])

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def mlflow_server(tmp_path):
    server = MlflowServer(tmp_path)
    yield server
    server.kill()
