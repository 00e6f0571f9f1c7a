"""The divergence guard on the default model: `python -m llama_fsdp` (the tiny Llama, 2 CPU
ranks, 60 steps) at the recipe's lr 3e-3 against 3e-2 and 3e-1, each run twice: with the guard
as it ships (train.divergence.action=stop) and with it only warning (action=warn: the whole
curve, and where the guard would have stopped it). Writes benchmarks/divergence.md.

    .venv/bin/python benchmarks/divergence.py --out benchmarks/divergence.md

Each row is read back from the run's MLflow store (sqlite, in a temporary folder): its status,
the step the guard stopped it at (the tag "diverged at step"), its losses by step.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LRS = ("0.003", "0.03", "0.3")


def sweep(cwd: Path, action: str) -> tuple[dict[str, dict], float, str]:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{cwd}/mlflow.db"
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "llama_fsdp", "-m", f"train.lr={','.join(LRS)}",
                        f"train.divergence.action={action}", "cluster.device=cpu",
                        f"tracking.uri={uri}", f"tracking.experiment={action}"],
                       cwd=cwd, capture_output=True, text=True, timeout=1800,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - start
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(action)
    rows = {}
    for run in client.search_runs([exp.experiment_id]):
        if run.data.tags.get("llama_fsdp.kind") == "sweep":
            continue
        lr = run.data.params["train.lr"]
        losses = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "loss"),
                                          key=lambda m: m.step)]
        rows[lr] = {"status": run.data.tags.get("status"), "losses": losses,
                    "stopped": run.data.tags.get("diverged at step"),
                    "eval": run.data.metrics.get("eval_loss")}
    return rows, wall, r.stdout + r.stderr if not rows else ""


def would_stop(losses: list[float]) -> str | None:
    """Where the guard as it ships stops these losses (the warn runs' whole curves)."""
    sys.path.insert(0, str(REPO))
    from llama_fsdp.config.schema import DivergenceConfig
    from llama_fsdp.train.divergence import Diverged, DivergenceGuard

    guard = DivergenceGuard(DivergenceConfig())
    try:
        for step, loss in enumerate(losses, 1):
            guard.observe(step, loss)
    except Diverged as e:
        return f"({e.step})"
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "divergence.md")
    args = ap.parse_args()
    lines = ["# The divergence guard on the default model", "",
             "`python benchmarks/divergence.py`: `python -m llama_fsdp -m train.lr=0.003,0.03,0.3 "
             "train.divergence.action=stop|warn` (the tiny Llama, 2 CPU ranks, fp32, 60 steps, "
             "the tiny recipe's warm-up of 6 steps and cosine to 0.1 x lr). "
             f"torch {__import__('torch').__version__}, this machine ({os.cpu_count()} cores).",
             ""]
    for action in ("stop", "warn"):
        with tempfile.TemporaryDirectory() as tmp:
            rows, wall, failure = sweep(Path(tmp), action)
        if failure:
            raise SystemExit(failure[-4000:])
        lines += [f"## train.divergence.action={action} ({wall:.0f} s for the three runs)", "",
                  "| train.lr | status | stopped at step (warn: where stop would) | steps logged | first loss | lowest "
                  "| final loss | highest after the lowest |", "|---|---|---|---|---|---|---|---|"]
        for lr in LRS:
            row = rows[str(float(lr))] if str(float(lr)) in rows else rows[lr]
            ls = row["losses"]
            low = min(range(len(ls)), key=ls.__getitem__)
            stopped = row["stopped"] or (would_stop(ls) if action == "warn" else None)
            lines.append(f"| {lr} | {row['status']} | {stopped or '-'} | {len(ls)} | "
                         f"{ls[0]:.3f} | {ls[low]:.3f} (step {low + 1}) | {ls[-1]:.3f} | "
                         f"{max(ls[low:]):.3f} |")
        lines.append("")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
