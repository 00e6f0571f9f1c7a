"""A real `-m` sweep on local ranks: one MLflow run per point, a shared sweep id, a summary."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow]


def test_local_sweep_runs_every_point_and_summarizes(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "llama_fsdp", "-m", "train.batch_size=2,4", "train.max_steps=2",
         "train.warmup_steps=1", "eval.every_steps=0", "eval.task_prompts=0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/outputs/mlflow.db")
    exp = client.get_experiment_by_name("llama_fsdp")
    runs = client.search_runs([exp.experiment_id])
    points = [r for r in runs if r.data.tags.get("llama_fsdp.kind") != "sweep-summary"]
    summaries = [r for r in runs if r.data.tags.get("llama_fsdp.kind") == "sweep-summary"]
    assert len(points) == 2 and len(summaries) == 1
    sweep_ids = {r.data.tags["sweep_id"] for r in runs}
    assert len(sweep_ids) == 1
    assert sorted(r.data.params["train.batch_size"] for r in points) == ["2", "4"]
    assert all(r.info.status == "FINISHED" for r in points)
    artifacts = {a.path for a in client.list_artifacts(summaries[0].info.run_id)}
    assert {"sweep_summary.md", "sweep_summary.png"} <= artifacts
    table = (out.stdout + out.stderr).split("summary:")[-1]
    assert "train.batch_size" in table and "tokens_per_sec" in table

    # the same summary on demand, by sweep id
    sid = sweep_ids.pop()
    again = subprocess.run([sys.executable, "-m", "llama_fsdp.sweep", sid], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "train.batch_size" in again.stderr + again.stdout
