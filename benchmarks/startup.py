"""How long the command takes to start: a dry run, and the default run up to its first training
step, with what each imports (``python -X importtime``).

    .venv/bin/python benchmarks/startup.py --rounds 3 --label now --out benchmarks/startup.md

``--python`` times another installation (another checkout's venv) the same way, for a before /
after table: each run is a new process of that interpreter, in a folder of its own whose
tokenizer and data caches a first, untimed run filled (a user's second run onward). The first
step is read from the run's tracking spool (rank 0's timestamp of step 1's metrics), against
the moment the command was started.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUN = ["train.max_steps=3"]
HEAVY = ("torch", "transformers", "mlflow", "datasets", "hydra", "omegaconf", "submitit",
         "llama_fsdp")


def imports(python: str, args: list[str], cwd: Path) -> dict[str, float]:
    """Seconds of each heavy package's import in the command (-X importtime: the cumulative
    time of the line that imports the package itself; one package may import another)."""
    r = subprocess.run([python, "-X", "importtime", "-m", "llama_fsdp", *args], cwd=cwd,
                       capture_output=True, text=True, timeout=600)
    out: dict[str, float] = {}
    for line in r.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| *(\S+)$", line)
        if m and m.group(2) in HEAVY:
            out[m.group(2)] = int(m.group(1)) / 1e6
    return out


def dry_run(python: str, cwd: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run([python, "-m", "llama_fsdp", "dry_run=true"], cwd=cwd, check=True,
                   capture_output=True, timeout=600)
    return time.perf_counter() - t0


def default_run(python: str, cwd: Path) -> tuple[float, float]:
    """(seconds to step 1's metrics, seconds to the command's end)."""
    t0 = time.time()
    subprocess.run([python, "-m", "llama_fsdp", *RUN], cwd=cwd, check=True,
                   capture_output=True, timeout=900)
    end = time.time() - t0
    run = sorted((cwd / "outputs" / "runs").glob("*/*"), key=os.path.getmtime)[-1]
    for line in (run / "tracking" / "spool.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("t") == "metrics" and e.get("step") == 1 and "loss" in e.get("m", {}):
            return e["ts"] / 1000 - t0, end
    raise RuntimeError(f"no step 1 in {run}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="startup-"))
    default_run(a.python, work)  # caches filled: the tokenizer, the tokenized data
    dry, first, total = [], [], []
    for _ in range(a.rounds):
        dry.append(dry_run(a.python, work))
        f, t = default_run(a.python, work)
        first.append(f)
        total.append(t)
    dry_imports = imports(a.python, ["dry_run=true"], work)
    med = statistics.median
    row = (f"| {a.label} | {med(dry):.2f} ({min(dry):.2f}-{max(dry):.2f}) | "
           f"{med(first):.2f} ({min(first):.2f}-{max(first):.2f}) | "
           f"{med(total):.2f} ({min(total):.2f}-{max(total):.2f}) | "
           + ", ".join(f"{k} {v:.2f}" for k, v in sorted(dry_imports.items(),
                                                      key=lambda kv: -kv[1])) + " |")
    print(row)
    if a.out:
        if not a.out.exists():
            a.out.write_text(
                "| checkout | dry run, s | default run: command to step 1, s | default run, "
                "whole (3 steps), s | the dry run's imports, s |\n|---|---|---|---|---|\n")
        with a.out.open("a") as f:
            f.write(row + "\n")


if __name__ == "__main__":
    main()
