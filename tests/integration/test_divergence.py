"""The divergence guard as a user meets it: a real `-m` sweep on local gloo ranks over
train.lr = the tiny recipe's 3e-3, 3.0 (runs away) and 1e20 (NaN at step 2), 8 steps with a
checkpoint every step, tracked in a real MLflow store (sqlite)."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from tests import warm

pytestmark = [pytest.mark.slow]

POINTS = {"0.003": "finished", "3.0": "diverged", "1e+20": "diverged"}  # (as MLflow has them)
REPORT = ("learning rate at step", "(peak ", "train.lr; the recipe's is 0.003)",
          "last good checkpoint: step_000001 (resume=auto continues from it)",
          "fix: lower the learning rate, e.g. train.lr=0.003 (the recipe's: or drop the "
          "override)", "train.divergence.action=warn only warns and trains on")


@pytest.fixture(scope="session")
def sweep(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("diverge")
    uri = f"sqlite:///{cwd}/mlflow.db"
    r = subprocess.run(
        [warm.python(), "-m", "llama_fsdp", "-m", "train.lr=0.003,3.0,1e20",
         "train.max_steps=8", "save.every_steps=1", "eval.every_steps=0",
         "eval.task_prompts=0", "cluster.device=cpu", f"tracking.uri={uri}",
         # no eval here (no eval loss): the best point by the final training loss
         "tracking.best_metric=summary/final_loss"],
        cwd=cwd, env=dict(os.environ), capture_output=True, text=True, timeout=900)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("llama_fsdp")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if r.data.tags.get("llama_fsdp.kind") == "sweep")
    points = {r.data.params["train.lr"]: r for r in runs if r is not parent}
    dirs = {lr: Path(p.data.tags["output_dir"]) for lr, p in points.items()}
    return {"r": r, "out": r.stdout + r.stderr, "points": points, "parent": parent,
            "dirs": dirs}


def _report(out: str, step: int) -> list[str]:
    """The report the command printed for the point that diverged at ``step``."""
    start = out.index(f"  diverged       the loss diverged at step {step} ")
    return [line.strip() for line in out[start:].splitlines()[:4]]


def test_a_run_that_runs_away_stops_with_a_report_and_exit_code_3(sweep):
    out = sweep["out"]
    assert sweep["r"].returncode == 3, out[-3000:]
    assert "Traceback" not in out  # the report, never a traceback (that is in diverged.txt)
    # lr=3.0: 6.4 -> 254 -> 1796 (a run the NaN check ended at step 22 before): at step 3 the
    # median of the three is 254, 39.5 times the lowest (6.416)
    away = _report(out, 3)
    m = re.search(r"\(the median of the last 3 log steps' losses, ([\d.]+), is ([\d.]+)x the "
                  r"lowest so far \(6\.416\) and ([\d.]+) above it\)", away[0])
    assert m and "1: 6.416, 2: " in away[0], away[0]
    median, times, above = (float(g) for g in m.groups())
    assert times >= 1.5 and above >= 1.0 and median == pytest.approx(6.416 * times, rel=0.01)
    nan = _report(out, 2)
    assert "(the loss is nan); the last losses by step: 1: 6.416, 2: nan" in nan[0]
    for report in (away, nan):  # the NaN path gives the same report
        text = "\n".join(report)
        assert all(part in text for part in REPORT), text
    assert out.count("status         diverged") == 2 and out.count("status         finished") == 1
    assert "2 point(s) of sweep" in out and "diverged: lr=3.0, lr=1e+20" in out


def test_the_last_good_checkpoint_is_kept_and_the_traceback_is_in_the_run_folder(sweep):
    for lr in ("3.0", "1e+20"):
        run = sweep["dirs"][lr]
        # step 2 of lr=3.0 was above the line (not saved), step 3 diverged: step 1 is the last
        assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000001"]
        text = (run / "diverged.txt").read_text()
        assert text.startswith("the loss diverged at step") and "fix: lower" in text
        assert "Traceback (most recent call last)" in text and "Diverged:" in text
    assert not (sweep["dirs"]["0.003"] / "diverged.txt").exists()


def test_mlflow_shows_failed_diverged_and_the_summary_never_picks_it(sweep):
    points, parent = sweep["points"], sweep["parent"]
    assert set(points) == set(POINTS)
    for lr, word in POINTS.items():
        run = points[lr]
        assert run.data.tags["status"] == word, lr
        assert run.info.status == ("FINISHED" if word == "finished" else "FAILED"), lr
        # the values in use and their sources: train.lr given, the rest the tiny recipe's
        p = run.data.params
        assert p["source.train.lr"] == "train.lr" and p["recipe"] == "tiny full sft"
        assert p["train.warmup_steps"] == "0" and p["source.train.warmup_steps"] == (
            "recipe: tiny full sft: 6, shortened to a tenth of train.max_steps=8")
        assert p["train.beta2"] == "0.95" and p["source.train.beta2"] == "recipe: tiny full sft"
    assert points["3.0"].data.tags["diverged at step"] == "3"
    assert points["1e+20"].data.tags["diverged at step"] == "2"
    assert parent.data.tags["best point"] == points["0.003"].info.run_name
    table = sweep["out"][sweep["out"].index("summary:"):]
    assert "DIVERGED (step 3)" in table and "DIVERGED (step 2)" in table
