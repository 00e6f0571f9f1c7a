"""How long the printed `mlflow ui` command takes to answer, and what it starts.

    python benchmarks/mlflow_ui_startup.py [--repeats 3] [--out benchmarks/mlflow_ui_startup.md]

Each variant starts `mlflow ui --backend-store-uri sqlite:///<a run's store>` on a free port, as a
user would after `python -m llama_fsdp`, and times it from the command to the first answer of
the runs page's data call (``/ajax-api/2.0/mlflow/experiments/search``), counting the processes
it started (psutil, the whole tree) once it answers. The store is made by a real default run
beforehand (a copy per start, so no start finds another's state).
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "mlflow ui": ([], {}),
    "mlflow ui --workers 1": (["--workers", "1"], {}),
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui": (
        [], {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}),
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui --workers 1": (
        ["--workers", "1"], {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_store(work: Path) -> Path:
    """A real store: the default command, shrunk to 2 steps."""
    subprocess.run([sys.executable, "-m", "llama_fsdp", "train.max_steps=2",
                    "eval.task_prompts=0", "save.export_hf=false"], cwd=work, check=True,
                   capture_output=True, timeout=600)
    return work / "outputs" / "mlflow.db"


def start_once(db: Path, args: list[str], env: dict[str, str]) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as d:
        copy = Path(d) / "mlflow.db"
        shutil.copy(db, copy)
        port = free_port()
        mlflow = Path(sys.executable).with_name("mlflow")
        t0 = time.monotonic()
        p = subprocess.Popen([str(mlflow), "ui", "--backend-store-uri", f"sqlite:///{copy}",
                              "--port", str(port), *args], cwd=d, env={**os.environ, **env},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        url = f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/experiments/search?max_results=10"
        try:
            while True:
                if time.monotonic() - t0 > 300:
                    raise RuntimeError("no answer in 300 s")
                try:
                    with urllib.request.urlopen(url, timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.1)
            took = time.monotonic() - t0
            procs = 1 + len(psutil.Process(p.pid).children(recursive=True))
        finally:
            os.killpg(p.pid, 9)
            p.wait()
        return took, procs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ui_startup_"))
    db = make_store(work)
    lines = ["| command | answers after (s), median of %d | processes |" % a.repeats,
             "|---|---|---|"]
    for name, (args, env) in VARIANTS.items():
        runs = [start_once(db, args, env) for _ in range(a.repeats)]
        secs = statistics.median(t for t, _ in runs)
        lines.append(f"| `{name}` | {secs:.1f} ({', '.join(f'{t:.1f}' for t, _ in runs)}) | "
                     f"{runs[-1][1]} |")
        print(lines[-1], flush=True)
    shutil.rmtree(work, ignore_errors=True)
    if a.out:
        a.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
