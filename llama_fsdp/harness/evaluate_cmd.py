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
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from .. import harness
from ..config.schema import HarnessConfig
from .checks import context_of, finite_problem, output_problem, run_command, task_data_problems
from .models import ModelNotFound, resolve, run_of
from .store import Store, StoreRefused, choose_store, where

log = logging.getLogger("llama_fsdp.evaluate")


def _device(name: Optional[str]) -> str:
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def log_to_mlflow(store: Store, found: dict[str, float], results_path: Path,
                  step: int) -> Optional[str]:
    """Into the run's MLflow run in ``store`` (harness/store.py chose it, and whether the user's
    credentials go): the metrics at ``step`` and the results JSON. The run id, or None when the
    store is out of reach or holds the scores at this step already."""
    import time

    from mlflow.entities import Metric

    from ..tracking.store import FAST_FAIL_ENV, open_client

    os.environ.update(FAST_FAIL_ENV)  # a server that went away: a warning in seconds
    run_id, artifact = store.run_id, f"harness/step_{step:06d}/{harness.RESULTS_FILE}"
    try:
        if store.credentials or store.uri.startswith("sqlite:///"):
            client = open_client(store.uri)
            history = lambda k: client.get_metric_history(run_id, k)  # noqa: E731
            log_batch = lambda ms: client.log_batch(run_id, metrics=ms)  # noqa: E731
            uploaded = _upload(client, store, run_id, results_path, artifact)
        else:  # a server on this machine a run folder names: nothing of the user's is sent
            from ..tracking.mlflow_compat import anonymous_store

            rest = anonymous_store(store.uri)
            history = lambda k: rest.get_metric_history(run_id, k)  # noqa: E731
            log_batch = lambda ms: rest.log_batch(run_id, ms, [], [])  # noqa: E731
            uploaded = lambda: _put_anonymously(rest, store, results_path, artifact)  # noqa: E731
        now = int(time.time() * 1000)
        already = sorted(k for k in found if any(m.step == step for m in history(k)))
        if already:  # each step once: the run scored these at this step already
            log.warning("the MLflow run %s has %s at step %d already (the run's own harness): "
                        "not logged again; the scores are in %s", run_id,
                        ", ".join(already), step, results_path)
            return None
        log_batch([Metric(k, v, now, step) for k, v in sorted(found.items())])
        if not uploaded():
            log.warning("the results JSON is not uploaded: the run's artifacts live outside the "
                        "store at %s, which you did not name (--tracking-uri sends it); it is in "
                        "%s", where(store.uri), results_path)
    except Exception as e:  # noqa: BLE001 - the scores are on disk and printed either way
        log.warning("the scores were not logged to MLflow at %s (%s: %s); they are in %s",
                    where(store.uri), type(e).__name__, str(e).splitlines()[0][:300] if str(e)
                    else "", results_path)
        return None
    return run_id


def _upload(client: Any, store: Store, run_id: str, results: Path, artifact: str) -> \
        Callable[[], bool]:
    """The results JSON as the run's artifact: through the client to a store the user named; to
    a SQLite store a run folder names, only where its artifacts are files on this machine."""
    def upload() -> bool:
        if not store.credentials:
            location = client.get_run(run_id).info.artifact_uri or ""
            if "://" in location and not location.startswith("file://"):
                return False
        client.log_text(run_id, results.read_text(), artifact)
        return True
    return upload


def _put_anonymously(rest: Any, store: Store, results: Path, artifact: str) -> bool:
    from ..tracking.mlflow_compat import put_text_anonymously

    location = rest.get_run(store.run_id).info.artifact_uri or ""
    return put_text_anonymously(store.uri, location, artifact, results.read_text())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m llama_fsdp.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, nargs="?", help="a run directory, one of its "
                   "checkpoints, its export, an HF model folder or a PEFT adapter folder")
    p.add_argument("--tasks", help="lm-eval task names, comma-separated (bundled: "
                   "llama_fsdp_synthetic, llama_fsdp_synthetic_mc)")
    p.add_argument("--tasks-dir", action="store_true",
                   help="print the bundled tasks' folder (for lm_eval --include_path) and exit")
    p.add_argument("--include-path", default=None, help="a folder of your own task YAMLs")
    p.add_argument("--trust-task-code", action="store_true",
                   help="run the Python files the --include-path folder's YAMLs name "
                   "(!function): refused without it, naming the files")
    p.add_argument("--limit", type=float, default=None, help="documents per task")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=None)
    p.add_argument("--step", type=int, default=None,
                   help="a run's checkpoint at this step instead of its export")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if any)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None,
                   help="a new file for lm-eval's results JSON (default: <run>/harness/step_N/; "
                   "never over an existing file)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log into the run's MLflow run")
    p.add_argument("--tracking-uri", default=None,
                   help="the MLflow store to log into, your credentials with it (default: the "
                   "store the run's tracking/run.json names, without your credentials unless "
                   "it is MLFLOW_TRACKING_URI's)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    return run_command(_main, argv)


def _main(argv: Optional[list[str]]) -> int:
    p = _parser()
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
                      max_length=args.max_length, trust_task_code=args.trust_task_code)
    problems = [p for p in (finite_problem("--limit", args.limit, low=0, low_open=True),) if p]
    problems = problems or harness.harness_problems(  # before any weights are read
        h, include_key="--include-path", consent="--trust-task-code")
    if not problems and h.include_path and harness.lm_eval_installed():  # your task files
        problems = task_data_problems(harness.task_manager(h.include_path, h.tasks), h.tasks)
    try:
        store = None if args.no_mlflow else _store(args.model, args.tracking_uri)
    except StoreRefused as e:
        problems.append(str(e))
    out = None
    if not problems and args.output is not None:
        out = args.output.expanduser().absolute()
        problems += filter(None, [output_problem(out, "--output", "give a new file name")])
    if problems:
        for line in problems:
            log.error("%s", line)
        return 2
    if store is not None:
        log.info("MLflow store: %s", store.shown())
    try:
        with resolve(args.model, step=args.step) as found:
            step = found.step or 0
            if out is None:  # the run's folder, or here: a new name beside earlier results
                out = harness.unused(found.run_dir / "harness" / f"step_{step:06d}" /
                                     harness.RESULTS_FILE if found.run_dir else
                                     Path("harness_results.json").absolute())
                if problem := output_problem(out, "the results", "give --output PATH"):
                    log.error("%s", problem)
                    return 2
            if problem := _fewshot_problem(args.num_fewshot, found.hf_dir):
                log.error("%s", problem)
                return 2
            log.info("evaluating %s: %s", found.what, ", ".join(h.tasks))
            results = harness.evaluate(found.hf_dir, h, device=_device(args.device),
                                       seed=args.seed)
            out = harness.write_results(results, out, exclusive=True)
            scores = harness.metrics(results)
            run_id = log_to_mlflow(store, scores, out, step) if store is not None else None
    except ModelNotFound as e:
        log.error("%s", e)
        return 2
    except ValueError as e:
        if "Sample larger than population" not in str(e):  # lm-eval's few-shot sampler
            raise
        log.error("--num-fewshot %s is more than the task's documents to draw examples from: "
                  "give fewer", args.num_fewshot)
        return 2
    print(f"harness        {harness.describe(results)}")
    print(f"results        {out}")
    if run_id and store is not None:
        print(f"mlflow run     {run_id} at {where(store.uri)} (harness/<task>/<metric> at step "
              f"{step})")
    return 0


def _store(model: Path, asked: Optional[str]) -> Optional[Store]:
    """The store the scores go to (None: no run, or a run without an MLflow run)."""
    run = run_of(model.expanduser().absolute())
    if run is None and asked:
        log.warning("--tracking-uri: %s is not a run directory, which has no MLflow run to log "
                    "into; the scores go to the results file only", model)
    return choose_store(run, asked) if run is not None else None


def _fewshot_problem(n: Optional[int], hf_dir: Path) -> Optional[str]:
    """More few-shot examples than the model's context has tokens cannot fit a prompt."""
    context = context_of(hf_dir)
    if n is not None and context is not None and n >= context:
        return (f"--num-fewshot {n}: that many examples cannot fit the model's context of "
                f"{context} tokens (max_position_embeddings): give fewer")
    return None


if __name__ == "__main__":
    sys.exit(main())
