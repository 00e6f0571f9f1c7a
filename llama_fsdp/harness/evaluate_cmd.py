"""`python -m llama_fsdp.evaluate RUN_DIR_OR_HF_DIR --tasks ...`: lm-evaluation-harness on a
finished run (its export, or any of its checkpoints with --step), or on any HF directory.

    python -m llama_fsdp.evaluate outputs/runs/<day>/<time> --tasks llama_fsdp_synthetic
    python -m llama_fsdp.evaluate outputs/runs/<day>/<time> --step 40 --tasks arc_easy --limit 200
    python -m llama_fsdp.evaluate /models/Llama-3.2-1B --tasks hellaswag,arc_easy

The scores are logged into the run's MLflow run when there is one (harness/<task>/<metric> at
the step of the weights, lm-eval's results JSON as harness/step_N/results.json), and lm-eval's
results JSON is written to <run>/harness/step_N/results.json (or --output).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional

from .. import harness
from ..config.schema import HarnessConfig
from .models import ModelNotFound, resolve

log = logging.getLogger("llama_fsdp.evaluate")


def _device(name: Optional[str]) -> str:
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def log_to_mlflow(run_dir: Path, found: dict[str, float], results_path: Path,
                  step: int) -> Optional[str]:
    """Into the run's MLflow run (its tracking/run.json names it): the metrics at ``step`` and
    the results JSON. The run id, or None when the run has none or the store is out of reach."""
    from ..tracking.spool import read_run_file

    info = read_run_file(run_dir)
    if not info.get("run_id"):
        return None
    try:
        from mlflow import MlflowClient
        from mlflow.entities import Metric

        from ..config.credentials import export_credentials

        export_credentials(info["tracking_uri"])
        client = MlflowClient(info["tracking_uri"])
        import time

        now = int(time.time() * 1000)
        already = sorted(k for k in found if any(
            m.step == step for m in client.get_metric_history(info["run_id"], k)))
        if already:  # each step once: the run scored these at this step already
            log.warning("the MLflow run %s has %s at step %d already (the run's own harness): "
                        "not logged again; the scores are in %s", info["run_id"],
                        ", ".join(already), step, results_path)
            return None
        client.log_batch(info["run_id"], metrics=[Metric(k, v, now, step)
                                                  for k, v in sorted(found.items())])
        client.log_text(info["run_id"], results_path.read_text(),
                        f"harness/step_{step:06d}/{harness.RESULTS_FILE}")
    except Exception as e:  # noqa: BLE001 - the scores are on disk and printed either way
        log.warning("the scores were not logged to MLflow (%s: %s); they are in %s",
                    type(e).__name__, e, results_path)
        return None
    return info["run_id"]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llama_fsdp.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, nargs="?", help="a run directory, one of its "
                   "checkpoints, its export, an HF model folder or a PEFT adapter folder")
    p.add_argument("--tasks", help="lm-eval task names, comma-separated (bundled: "
                   "llama_fsdp_synthetic, llama_fsdp_synthetic_mc)")
    p.add_argument("--tasks-dir", action="store_true",
                   help="print the bundled tasks' folder (for lm_eval --include_path) and exit")
    p.add_argument("--include-path", default=None, help="a folder of your own task YAMLs")
    p.add_argument("--limit", type=float, default=None, help="documents per task")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=None)
    p.add_argument("--step", type=int, default=None,
                   help="a run's checkpoint at this step instead of its export")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if any)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None,
                   help="where lm-eval's results JSON goes (default: <run>/harness/step_N/)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log into the run's MLflow run")
    args = p.parse_args(argv)
    if args.tasks_dir:
        print(harness.TASKS_DIR)
        return 0
    if args.model is None or not args.tasks:
        p.error("give the model (a run directory or an HF folder) and --tasks")
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s",
                        datefmt="%H:%M:%S")
    h = HarnessConfig(tasks=[t.strip() for t in args.tasks.split(",") if t.strip()],
                      include_path=args.include_path, limit=args.limit,
                      num_fewshot=args.num_fewshot, batch_size=args.batch_size,
                      max_length=args.max_length)
    if problems := harness.harness_problems(h):  # before any weights are read
        for line in problems:
            log.error("%s", line)
        return 2
    try:
        with resolve(args.model, step=args.step) as found:
            log.info("evaluating %s: %s", found.what, ", ".join(h.tasks))
            results = harness.evaluate(found.hf_dir, h, device=_device(args.device),
                                       seed=args.seed)
            step = found.step or 0
            out = args.output or harness.unused(
                found.run_dir / "harness" / f"step_{step:06d}" / harness.RESULTS_FILE
                if found.run_dir else Path("harness_results.json"))
            harness.write_results(results, out)
            scores = harness.metrics(results)
            run_id = (log_to_mlflow(found.run_dir, scores, out, step)
                      if found.run_dir and not args.no_mlflow else None)
    except ModelNotFound as e:
        log.error("%s", e)
        return 2
    print(f"harness        {harness.describe(results)}")
    print(f"results        {out}")
    if run_id:
        print(f"mlflow run     {run_id} (harness/<task>/<metric> at step {step})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
