"""What the command line prints when a run ends (its report): rank 0's result read back
(status, steps, losses, throughput, peak memory), where the run is, how to continue it, and its
MLflow run."""
from __future__ import annotations

from typing import Any

from .overrides import command_line
from ..config import metrics as names
from ..config.status import DIVERGED, FINISHED, PRUNED
from ..harness import BUNDLED_TASK, LOCAL_REAL_TASK, PREFIX, hub_reachable
from ..run.spec import RunSpec
from ..tracking import read_run_file, runs_page
from ..tracking.store import ui_command


def _loads_whole(spec: RunSpec) -> bool:
    """The run left a whole model the commands load: its HF export, or under adapters the
    merged one (a PEFT adapter over a hub base loads too; over a random base it cannot)."""
    ft = spec.finetune
    return not ft.adapters or ft.export_merged or spec.model.path is not None


def evaluate_task(spec: RunSpec) -> str:
    """The lm-eval task the report suggests, one that runs where the run ran: the bundled
    synthetic task for the synthetic data; for real data hellaswag where the hub answers, else
    the bundled MMLU dev questions (read from lm-eval's own package)."""
    if spec.data.name == "synthetic":
        return BUNDLED_TASK
    return "hellaswag" if hub_reachable() else LOCAL_REAL_TASK


def report_lines(spec: RunSpec, rank0: Any) -> list[str]:
    """What is printed when a run ends, from rank 0's result."""
    s, final = rank0.summary, rank0.final
    lines = [f"status         {rank0.status}", f"steps          {rank0.steps}"]
    if names.LOSS in final:
        lines.append(f"final loss     {final[names.LOSS]:.4f}"
                     + (f"   eval loss {final[names.EVAL_LOSS]:.4f}"
                        if names.EVAL_LOSS in final else "")
                     + (f"   exact match {final[names.EVAL_EXACT_MATCH]:.2f}"
                        if names.EVAL_EXACT_MATCH in final else ""))
    if names.EVAL_REWARDS_ACCURACY in final:  # pairs: how often held-out pairs agree
        lines.append(f"rewards        held-out accuracy {final[names.EVAL_REWARDS_ACCURACY]:.2f} "
                     f"(chance 0.5), margin {final[names.EVAL_REWARDS_MARGIN]:.3f}")
    if names.SUMMARY_TOKENS_PER_SEC in s:
        lines.append(f"tokens/s       {s[names.SUMMARY_TOKENS_PER_SEC]:.0f} global, "
                     f"{s[names.SUMMARY_TOKENS_PER_SEC_PER_DEVICE]:.0f} per device (median of the "
                     "steady steps)"
                     + (f", MFU {s[names.SUMMARY_MFU]:.1%}" if names.SUMMARY_MFU in s else ""))
    if names.SUMMARY_PEAK_MEMORY in s:
        what = ("CUDA allocated" if spec.device == "cuda" else "process RSS, runtime included")
        lines.append(f"peak memory    {s[names.SUMMARY_PEAK_MEMORY]:.2f} GB ({what}, max over "
                     f"ranks; the plan's tensors {s[names.SUMMARY_PREDICTED_PEAK_MEMORY]:.2f} GB)")
    scores = {k: v for k, v in s.items() if k.startswith(PREFIX)}
    if scores:  # eval.harness at the end: lm-eval's headline metric per task
        lines.append("harness        " + "; ".join(
            f"{k[len(PREFIX):]} {v:.4f}" for k, v in sorted(scores.items()))
            + f" (lm-eval; {spec.output_dir}/harness/)")
    lines.append(f"run dir        {spec.output_dir}")
    if rank0.status == DIVERGED and rank0.report:  # its own fix: not "continue with" as it was
        lines += [f"diverged       {line}" if i == 0 else f"               {line}"
                  for i, line in enumerate(rank0.report.splitlines())]
    elif rank0.status == PRUNED:  # a search's trial: the search goes on without it
        lines.append("pruned         the search's pruner stopped this trial at an eval: the "
                     "search goes on with its other trials")
    elif rank0.status != FINISHED and rank0.checkpoints:
        lines.append(f"continue with  {command_line(drop=('output_dir', 'resume'))} "
                     f"output_dir={spec.output_dir} resume=auto")
    elif rank0.status != FINISHED:
        lines.append("no checkpoint  none was saved (save.every_steps=0), so this run cannot be "
                     "continued from where it stopped. Set save.every_steps=N to make a stopped "
                     "run resumable")
    if rank0.status == FINISHED and rank0.export_dir and _loads_whole(spec):
        task = evaluate_task(spec)
        ask = '"Opposite hot"' if spec.data.name == "synthetic" else '"your prompt"'
        lines.append(f"evaluate it    python -m llama_fsdp.evaluate {spec.output_dir} "
                     f"--tasks {task}")
        lines.append(f"talk to it     python -m llama_fsdp.generate {spec.output_dir} {ask}")
    if rank0.mlflow_run_id:
        lines.append(f"mlflow run     {rank0.mlflow_run_id} in experiment "
                     f"'{spec.tracking.experiment}' at {spec.tracking_uri}")
        page = runs_page(spec.tracking_uri, read_run_file(spec.output_dir).get("experiment_id", "0"),
                         view=spec.sweep_id)  # a sweep point: its sweep's own view
        if spec.tracking_uri.startswith("sqlite:///"):
            lines.append(f"compare runs   {ui_command(spec.tracking_uri)}, then open {page}")
        else:
            lines.append(f"compare runs   {page}")
    return lines
