"""`-m hydra/sweeper=optuna` as a user meets it: real searches on 2 local gloo CPU ranks over the
default task's train.lr (8 steps, eval at the end), tracked in a real sqlite MLflow store, the
study in the sweep's folder. One search meets a trial that diverges (1e20), one refused
(-1: before launch) and the recipe's 0.003, and is then resumed after an interruption; another
searches an interval with TPE and is held to the recipe's point; a third prunes a trial that
falls behind at an eval step."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from tests import docs_commands as docs
from tests import warm

pytestmark = [pytest.mark.slow]

SHORT = ["train.max_steps=8", "eval.every_steps=8", "eval.task_prompts=0", "cluster.device=cpu"]
# every choice once (Optuna's brute-force sampler), in its seeded order
FAILURES = ["hydra/sweeper/sampler=bruteforce",
            "hydra.sweeper.params.train.lr=choice(0.003, 1e20, -1)"]


def _search(cwd: Path, *args: str, short: tuple = tuple(SHORT)) -> subprocess.CompletedProcess:
    return subprocess.run(
        [warm.python(), "-m", "llama_fsdp", "-m", "hydra/sweeper=optuna", *args, *short,
         f"tracking.uri=sqlite:///{cwd}/mlflow.db", f"hydra.sweep.dir={cwd}/sweep"],
        cwd=cwd, env=dict(os.environ), capture_output=True, text=True, timeout=900)


def _study(cwd: Path):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(cwd / "sweep" / "optuna_study.jsonl")))
    return optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)


def _points(cwd: Path) -> tuple[object, list]:
    client = MlflowClient(tracking_uri=f"sqlite:///{cwd}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("llama_fsdp").experiment_id])
    parent = next(r for r in runs if r.data.tags.get("llama_fsdp.kind") == "sweep")
    return parent, [r for r in runs if r.data.tags.get("mlflow.parentRunId") ==
                    parent.info.run_id]


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    """The search with a diverged and a refused trial; then, as a killed sweeper leaves it, a
    trial left running (of the recipe's lr, before its launch), and the same command again with
    one more trial."""
    cwd = tmp_path_factory.mktemp("search_failures")
    first = _search(cwd, "hydra.sweeper.n_trials=3", *FAILURES)
    parent, points = _points(cwd)
    study = _study(cwd)
    study.enqueue_trial({"train.lr": "0.003"})
    from llama_fsdp.cli.search import SearchSpace

    left = study.ask(SearchSpace.of({}, [FAILURES[1].split(".", 3)[3]]).distributions())
    left.set_user_attr("run_dir", str(cwd / "sweep" / str(left.number)))
    again = _search(cwd, "hydra.sweeper.n_trials=4", *FAILURES)
    return {"cwd": cwd, "first": first, "parent": parent, "points": points, "again": again,
            "left": left.number}


def test_a_diverged_and_a_refused_trial_are_shown_and_neither_is_the_best(failures):
    r = failures["first"]
    out = r.stdout + r.stderr
    assert r.returncode == 3, out[-3000:]  # the worst point's code, as a grid's
    table = out[out.index("search sweep-"):]
    rows = {m.group(1): m.group(2) for m in re.finditer(
        r"^\d+\s+(0\.003|1e\+20|-1)\s+\S+\s+(\w+)$", table, re.M)}
    assert rows == {"0.003": "finished", "1e+20": "diverged", "-1": "refused"}, table
    assert re.search(r"best trial: \d+ \(lowest summary/eval_loss: [\d.]+\)\n"
                     r"  run it alone: python -m llama_fsdp train\.max_steps=8 .*"
                     r"train\.lr=0\.003$", table, re.M), table
    assert "hydra" not in table.split("run it alone: ")[1].splitlines()[0]
    summary = out[out.index("summary:"):]
    assert "DIVERGED (step 2)" in summary and "REFUSED (exit 2)" in summary
    assert "best point: as configured (lowest summary/eval_loss" in summary
    # Optuna was told no value for either: they failed; the best trial is the recipe's lr
    study = _study(failures["cwd"])
    states = {t.params["train.lr"]: (t.state.name, t.value) for t in study.trials[:3]}
    assert states["1e+20"] == ("FAIL", None) and states["-1"] == ("FAIL", None)
    assert study.best_trial.params == {"train.lr": "0.003"}
    # MLflow: the parent (the searched key its column), a child run per launched trial
    parent, points = failures["parent"], failures["points"]
    assert parent.data.params == {"train.lr": "choice(0.003, 1e20, -1)"}
    assert sorted(p.data.params["train.lr"] for p in points) == ["0.003", "1e+20"]
    # trial 0, the run as configured: the recipe's lr (0.003), the best
    assert study.trials[0].params == {"train.lr": "0.003"} and study.best_trial.number == 0
    assert parent.data.tags["best point"] == "as configured"
    assert parent.data.tags["sweep.points"] == "3"


def test_the_same_command_resumes_the_study_without_running_a_told_trial_again(failures):
    """The rerun asks only for the trial it lacks: the interrupted one, with its values; none of
    the three told trials launches again (their folders keep their one run each)."""
    r, cwd, left = failures["again"], failures["cwd"], failures["left"]
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert f"trial {left} was interrupted: it runs again (train.lr=0.003)" in out
    assert "trial(s) 4 of 4: train.lr=0.003" in out and "trial(s) 0" not in out
    _, points = _points(cwd)
    dirs = sorted(Path(p.data.tags["output_dir"]).name for p in points)
    assert dirs == sorted([str(t.number) for t in _study(cwd).trials[:3]
                           if t.params["train.lr"] != "-1"] + ["4"])
    table = out[out.index("search sweep-"):]
    assert re.search(rf"^{left}\s+0\.003\s+-\s+interrupted$", table, re.M), table
    # the refused trial, not run again, keeps its row in the summary
    assert "REFUSED (exit 2)" in out[out.index("summary:"):]


def test_a_search_finds_a_point_at_least_as_good_as_the_recipes(failures, tmp_path):
    """docs/mlflow.md's search, as a user runs it (three trials of TPE, seeded, over a log
    interval around the recipe's lr, 8 steps): its trial 0 is the run as configured (the
    recipe's lr, read back from its run), and its best at least as good as the recipe's point
    (the first search's trial 0, the same 8 steps); the chart of the objective is on the
    parent run."""
    cmd, env = docs.command("search_lr")
    r = docs.run(cmd, tmp_path, env, timeout=900)
    assert r.returncode == 0, str(r)
    assert re.search(r"^0\s+0\.003\s+[\d.]+\s+finished$", r.output, re.M), r.output[-3000:]
    recipe = next(p for p in failures["points"] if p.data.params["train.lr"] == "0.003")
    recipe_loss = recipe.data.metrics["summary/eval_loss"]
    best = re.search(r"best trial: (\d+) \(lowest summary/eval_loss: ([\d.]+)\)\n"
                     r"  run it alone: python -m llama_fsdp .*train\.lr=([\d.e-]+)$", r.output,
                     re.M)
    assert best and float(best.group(2)) <= recipe_loss + 5e-4, (r.output[-3000:], recipe_loss)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/outputs/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("llama_fsdp").experiment_id])
    parent = next(r for r in runs if r.data.tags.get("llama_fsdp.kind") == "sweep")
    points = [p for p in runs if p.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(points) == 3 and parent.data.tags["sweep.points"] == "3"
    top = next(p for p in points if Path(p.data.tags["output_dir"]).name == best.group(1))
    assert parent.data.tags["best point"] == top.info.run_name
    assert top.data.params["train.lr"] == best.group(3)
    assert parent.data.params == {"train.lr": "tag(log, interval(1e-3, 3e-2))"}
    arts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"search_objective.png", "search_trials.md"} <= arts


def test_a_trial_behind_at_an_eval_step_is_pruned_and_shown_as_pruned_not_failed(tmp_path):
    """Two trials over train.lr (every choice once), eval every 3 of 6 steps, the threshold
    pruner (hydra/sweeper/pruner=threshold: an eval loss above 5.0 stops a trial; the task
    starts at 6.4): lr 1e-7 barely moves and stops at step 3, lr 0.003 is under 4 there and
    runs its 6 steps. The pruned trial is PRUNED in the study (its value the eval it stopped
    at), its MLflow run KILLED with the status "pruned" and the step, its loss logged to step 3
    only; the sweep is not failed, and the other trial is the best."""
    r = _search(tmp_path, "hydra.sweeper.n_trials=2", "hydra.sweeper.baseline=false",
                "hydra/sweeper/sampler=bruteforce",
                "hydra.sweeper.params.train.lr=choice(0.003, 1e-7)",
                "hydra/sweeper/pruner=threshold", "hydra.sweeper.pruner.upper=5.0",
                short=("train.max_steps=6", "eval.every_steps=3", *SHORT[2:]))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "pruning: ThresholdPruner on eval_loss at each eval step after step 0" in out
    table = out[out.index("search sweep-"):]
    assert re.search(r"^\d+\s+1e-07\s+6\.\d+\s+pruned$", table, re.M), table
    assert re.search(r"^\d+\s+0\.003\s+[\d.]+\s+finished$", table, re.M), table
    assert "best trial: " in table and table.split("run it alone: ")[1].splitlines()[0] \
        .endswith("train.lr=0.003")
    assert "PRUNED (step 3)" in out[out.index("summary:"):]
    study = _study(tmp_path)
    slow, fast = sorted(study.trials, key=lambda t: float(t.params["train.lr"]))
    assert slow.state.name == "PRUNED" and list(slow.intermediate_values) == [3]
    assert slow.value == slow.intermediate_values[3] > 5.0
    assert fast.state.name == "COMPLETE" and fast.value < slow.value
    parent, points = _points(tmp_path)
    pruned = next(p for p in points if p.data.params["train.lr"] == "1e-07")
    assert pruned.info.status == "KILLED"
    assert pruned.data.tags["status"] == "pruned" and pruned.data.tags["pruned at step"] == "3"
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    assert [m.step for m in client.get_metric_history(pruned.info.run_id, "loss")] == [1, 2, 3]
    assert parent.data.tags["status"] == "finished" and parent.data.tags["failed_points"] == "0"
    assert parent.data.tags["best point"] == "lr=0.003"
