"""eval.harness inside a run (llama_fsdp/harness/ runs lm-eval): at the end on the export, and
every eval.harness.every_steps on the model exported at that step into <run>/harness/step_N/
(removed once scored). Rank 0 scores; the others wait (periodic) or are done (at the end)."""
from __future__ import annotations

import gc
import logging
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import harness
from ..config.rundir import RunDir

log = logging.getLogger("llama_fsdp.train.harness")

HARNESS_DIR = "harness"


def step_dir(output_dir: str, step: int) -> Path:
    return Path(output_dir) / HARNESS_DIR / f"step_{step:06d}"


def model_dir_of(spec: Any) -> Path:
    """The export the harness scores: the merged model under adapters, else the HF export."""
    run = RunDir(spec.output_dir)
    return run.export_merged if spec.finetune.adapters else run.export


def score(spec: Any, model_dir: Path, *, step: int, device: torch.device,
          tracker: Any) -> dict[str, float]:
    """Rank 0: lm-eval on ``model_dir``; its metrics logged at ``step``, its results JSON in
    <run>/harness/step_N/results.json and in MLflow (harness/step_N/results.json)."""
    h = spec.eval.harness
    log.info("eval.harness: %s on %s (step %d)%s", ", ".join(h.tasks), model_dir, step,
             f", {h.limit:g} documents per task" if h.limit else "")
    results = harness.evaluate(model_dir, h, device=str(device), seed=spec.train.seed)
    where = harness.write_results(results, step_dir(spec.output_dir, step) / harness.RESULTS_FILE)
    found = harness.metrics(results)
    tracker.log_metrics(found, step=step)
    tracker.log_text(where.read_text(), f"{HARNESS_DIR}/step_{step:06d}/{harness.RESULTS_FILE}")
    log.info("eval.harness at step %d: %s (lm-eval's results: %s)", step,
             harness.describe(results), where)
    return found


def periodic(spec: Any, *, rank: int, device: torch.device, tracker: Any,
             export: Callable[[Path], Any]) -> Callable[[Any], None]:
    """An on_step_end callback: every eval.harness.every_steps (not at the last step, which the
    end scores), every rank writes its part of the export at that step (``export``, collective),
    rank 0 scores it and removes it, and the ranks go on together."""
    h, last = spec.eval.harness, spec.train.max_steps

    def at(state: Any) -> None:
        if not (h.tasks and h.every_steps) or state.step % h.every_steps or state.step >= last:
            return
        where = step_dir(spec.output_dir, state.step) / "model"
        export(where)
        if rank == 0:
            try:
                score(spec, where, step=state.step, device=device, tracker=tracker)
            finally:
                shutil.rmtree(where, ignore_errors=True)
                gc.collect()
        dist.barrier()

    return at


def free() -> None:
    """Give back what the training state held, before the end's harness loads the whole model."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
