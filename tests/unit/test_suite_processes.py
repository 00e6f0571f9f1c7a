"""What the suite starts in sessions of its own ends with the pytest process that started it,
however that ends: a `make test` stopped by a timeout's SIGKILL left the docs module's
`mlflow ui` and a sweep test's `mlflow server` running, adopted by init (tests/reaper.py), and
the warm interpreters of tests/warm.py would have stayed as well."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO

INNER = '''
import json, os, subprocess, time
from pathlib import Path
from tests import docs_commands as docs, warm

def test_hold(tmp_path):
    server = docs.start("exec python -m http.server 0 --bind 127.0.0.1", tmp_path)
    r = subprocess.run([warm.python(), "-m", "llama_fsdp", "dry_run=true", "cluster.device=cpu",
                        f"hydra.run.dir={{tmp_path}}/r"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    warm_dir = os.environ[warm.DIR_ENV]
    zygotes = [int(Path(warm_dir, n).read_text()) for n in os.listdir(warm_dir)
               if n.endswith(".pid")]
    Path({pids!r}).write_text(json.dumps({{"server": server.pid, "zygotes": zygotes}}))
    time.sleep(600)
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_killed_pytest_takes_its_servers_and_warm_interpreters_with_it(tmp_path):
    pids = tmp_path / "pids.json"
    (tmp_path / "test_inner.py").write_text(INNER.format(pids=str(pids)))
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not pids.exists() and inner.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pids.exists(), f"the inner session ended ({inner.returncode}) or took too long"
        started = json.loads(pids.read_text())
        held = [started["server"], *started["zygotes"]]
        assert started["zygotes"] and all(_alive(p) for p in held), started  # positive control
        inner.send_signal(signal.SIGKILL)
        inner.wait()
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in held) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in held if _alive(p)] == [], started
    finally:
        if inner.poll() is None:
            os.killpg(inner.pid, signal.SIGKILL)
