"""What the MLflow UI shows, in its pure parts: a run's note (the command, one override per line;
a sweep point's own overrides), a logged model's name, the rounded columns, the saved view's
column order, and a sweep's progress (a point still queued or running is never a failed one,
and the best point is a finished one). The browser test (tests/integration/test_sweep_local.py)
checks the same things as a person sees them."""
from __future__ import annotations

import json

import pytest

from llama_fsdp.config import metrics as names
from llama_fsdp.cli.overrides import command_args, sweep_size
from llama_fsdp.tracking.sweep import Best, best_run, progress
from llama_fsdp.tracking.view import (
    COLUMNS,
    RUNS_QUERY,
    SHOWN,
    command_note,
    experiment_tags,
    model_name,
    shown_metrics,
    view_is_current,
    view_state,
)


def test_a_note_puts_one_override_per_line_with_the_sweep_flag_beside_the_program():
    note = command_note("python -m llama_fsdp -m finetune=full,lora,qlora train.max_steps=6 "
                        "'data.path=/my data/x.jsonl'")
    assert note.splitlines() == ["```", "python -m llama_fsdp -m \\",
                                 "  finetune=full,lora,qlora \\", "  train.max_steps=6 \\",
                                 "  'data.path=/my data/x.jsonl'", "```"]
    assert command_note("llama-fsdp", "Sweep s:").splitlines() == ["Sweep s:", "", "```",
                                                                  "llama-fsdp", "```"]


def test_a_sweep_points_command_is_its_own_overrides():
    argv = ["-m", "finetune=full,lora,qlora", "train.max_steps=6", "train.lr=0.1,0.2",
            "tracking.uri=http://h:5"]
    point = {"finetune": "lora", "train.lr": "0.2"}
    assert command_args(argv, point=point) == ["finetune=lora", "train.max_steps=6",
                                               "train.lr=0.2", "tracking.uri=http://h:5"]
    assert command_args(argv) == argv  # a single run, or the sweep itself: as typed
    assert command_args(argv, drop=("train.lr",), point=point) == [
        "finetune=lora", "train.max_steps=6", "tracking.uri=http://h:5"]
    assert sweep_size(argv) == 6 and sweep_size(["a=1"]) == 1


def test_a_model_is_named_for_its_run_and_sweep_without_what_mlflow_refuses():
    assert model_name("tiny full fp32 2xcpu b8") == "tiny full fp32 2xcpu b8"
    assert model_name("finetune=lora", "sweep-2026-11-26_09-26-49-363271") == \
        "finetune=lora (sweep-2026-11-26_09-26-49-363271)"
    # MLflow refuses / : . % and quotes in a logged model's name
    assert model_name("lr=0.001 data=a/b", "s") == "lr=0_001 data=a_b (s)"


def test_the_columns_are_rounded_copies_of_the_exact_metrics():
    exact = {names.SUMMARY_TOKENS_PER_SEC: 7317.475065965187, names.SUMMARY_FINAL_LOSS: 4.38571357,
             names.SUMMARY_PEAK_MEMORY: 0.884712, names.SUMMARY_PREDICTED_PEAK_MEMORY: 0.0973114,
             names.SUMMARY_MFU: 0.42345, names.TRAINABLE_PARAMS: 311_296,
             names.TOTAL_PARAMS: 3_721_472, names.BASE_PARAMS: 3_410_176,
             names.SUMMARY_EVAL_LOSS: float("nan")}
    assert shown_metrics(exact) == {"tokens per sec": 7317.0, "final loss": 4.386,
                                    "peak GB": 0.885, "planned GB": 0.0973, "MFU pct": 42.3,
                                    "trainable M": 0.311, "trainable pct": 8.36, "base M": 3.41}
    # what a run lacks (MFU on a CPU, eval loss with eval off) is no column value
    assert shown_metrics({names.TRAINABLE_PARAMS: 5, names.TOTAL_PARAMS: 5}) == {
        "trainable M": 5e-06, "trainable pct": 100.0}


def test_the_view_shows_what_runs_differ_in_before_the_data_set_and_model():
    order = view_state()["columnOrder"]
    first = order.index("attributes.`Dataset`")
    assert first < order.index("attributes.`Models`")
    before = order[:first]
    for column in ("tags.`status`", "params.`finetune.method`", "metrics.`trainable M`",
                   "metrics.`trainable pct`", "metrics.`final loss`", "metrics.`eval loss`",
                   "metrics.`tokens per sec`", "metrics.`MFU pct`", "metrics.`peak GB`",
                   "metrics.`planned GB`", "duration"):
        assert column in before, column
    assert "tags.`precision`" in order and "params.`precision.name`" not in order  # resolved
    assert all(f"metrics.`{s.name}`" in order for s in SHOWN)
    assert set(view_state()["columnWidths"]) == {c for c, _ in COLUMNS}
    assert RUNS_QUERY == "workflowType=machine_learning&viewStateShareKey=llama_fsdp"


# MLflow 3.17's runs table at a 1600 px wide window, its sidebar open: the table's width and
# its row-selection column (measured in Chromium); a vertical scrollbar takes up to 15 px more
TABLE_PX, SELECT_PX, SCROLLBAR_PX = 1346, 73, 15


def test_the_first_screens_columns_fit_1600_px_with_a_scrollbar():
    """MFU included (the browser test runs on a CPU, which has none)."""
    ids = [c for c, _ in COLUMNS]
    first = ids[:ids.index("duration") + 1]
    assert "metrics.`MFU pct`" in first
    assert SELECT_PX + sum(w for c, w in COLUMNS if c in first) + SCROLLBAR_PX <= TABLE_PX


def test_the_charts_start_with_the_loss_and_show_the_summary_as_bars():
    state = view_state()
    sections = [s["name"] for s in state["compareRunSections"]]
    assert sections[:2] == ["Model metrics", "summary"]
    charts = [c for c in state["compareRunCharts"] if not c["deleted"]]
    assert [c["metricKey"] for c in charts[:2]] == [names.LOSS, names.EVAL_LOSS]
    assert {c["type"] for c in charts if c["metricKey"].startswith("summary/")} == {"BAR"}
    # the rounded copies are no charts of their own
    assert {c["metricKey"] for c in state["compareRunCharts"] if c["deleted"]} == \
        {s.name for s in SHOWN}


def test_an_earlier_view_is_replaced_and_its_creation_kept():
    current = experiment_tags()["mlflow.sharedViewState.llama_fsdp"]
    assert view_is_current(current)
    old = json.dumps({"name": "v", "createdAt": 5, "state": json.dumps(
        {"selectedColumns": ["attributes.`Dataset`"]})})
    assert not view_is_current(old) and not view_is_current(None)
    assert json.loads(experiment_tags(old)["mlflow.sharedViewState.llama_fsdp"])["createdAt"] == 5


@pytest.mark.parametrize("statuses, refused, points, complete, status", [
    (["FINISHED", "RUNNING", "RUNNING"], 0, 3, False, "running 1/3"),
    # a SLURM sweep still submitting: 2 of its 4 points have no run yet
    (["FINISHED", "FINISHED"], 0, 4, False, "running 2/4"),
    (["FINISHED", "FAILED", "KILLED"], 0, 3, True, "2/3 failed"),
    (["FINISHED", "FINISHED"], 1, 3, True, "1/3 failed"),  # one refused before launch
    (["FINISHED", "FINISHED", "FINISHED"], 0, 3, True, "finished"),
    (["FINISHED", "RUNNING"], 0, None, False, "running 1/2"),  # the count not known
])
def test_a_sweep_is_final_only_when_every_point_has_ended(statuses, refused, points, complete,
                                                          status):
    state = progress(statuses, refused, points)
    assert state.complete == complete and state.status() == status
    assert state.failed == sum(s in ("FAILED", "KILLED") for s in statuses) + refused


def test_the_best_point_is_the_finished_one_with_the_best_chosen_metric(tmp_path):
    """Lowest eval loss by default, whatever the speed (issue 57: a sweep's parent showed the
    faster method's worse loss); another metric and direction when the sweep names them; a
    point that did not finish, or lacks the metric, is never the best."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.create_experiment("s")

    def run(name: str, eval_loss: float | None, tokens: float | None, status: str):
        r = client.create_run(exp, run_name=name)
        metrics = {names.SUMMARY_EVAL_LOSS: eval_loss, names.SUMMARY_TOKENS_PER_SEC: tokens}
        client.log_batch(r.info.run_id, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()
                                                 if v is not None])
        if status != "RUNNING":
            client.set_terminated(r.info.run_id, status=status)
        return client.get_run(r.info.run_id)

    runs = [run("full", 2.78, 100.0, "FINISHED"), run("failed", 1.0, 300.0, "FAILED"),
            run("lora", 3.92, 200.0, "FINISHED"), run("running", 0.5, 900.0, "RUNNING"),
            run("bare", None, None, "FINISHED"), run("nan", float("nan"), 50.0, "FINISHED")]
    assert best_run(runs).info.run_name == "full"  # not lora, the faster one
    assert str(Best()) == "lowest summary/eval_loss"
    assert Best().line(runs) == "best point: full (lowest summary/eval_loss: 2.78)"
    fastest = Best(names.SUMMARY_TOKENS_PER_SEC, "max")
    assert best_run(runs, fastest).info.run_name == "lora"
    assert str(fastest) == "highest summary/tokens_per_sec"
    assert best_run(runs[1:2]) is None and best_run(runs[3:5]) is None
    assert Best().line(runs[3:4]) == ("best point: none yet (no finished point has "
                                      "summary/eval_loss)")
    assert Best.of(fastest.tags()) == fastest and Best.of({}) == Best()


def test_a_new_run_brings_an_experiments_earlier_view_up_to_date(tmp_path):
    """A store made by an earlier version keeps its experiment (and a description the user
    wrote); the view tag is this version's once a run is created there."""
    from mlflow.tracking import MlflowClient

    from llama_fsdp.tracking import Spool, deliver_pending, events, write_run_file

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("llama_fsdp")
    old = json.dumps({"name": "v", "createdAt": 5, "state": json.dumps(
        {"selectedColumns": ["attributes.`Dataset`"]})})
    client.set_experiment_tag(exp, "mlflow.sharedViewState.llama_fsdp", old)
    client.set_experiment_tag(exp, "mlflow.note.content", "my notes")
    write_run_file(tmp_path / "run", {"tracking_uri": uri})
    Spool(tmp_path / "run").append(events.Create("llama_fsdp", "r"))
    assert deliver_pending(tmp_path / "run", deadline_s=30) == 0
    tags = client.get_experiment(exp).tags
    assert view_is_current(tags["mlflow.sharedViewState.llama_fsdp"])
    assert json.loads(tags["mlflow.sharedViewState.llama_fsdp"])["createdAt"] == 5
    assert tags["mlflow.note.content"] == "my notes"


def test_run_names_say_what_is_sharding_and_points_fit_the_name_column(spec_factory):
    """A single run's name says "shard=full" ("lora full" read as both); a sweep point's name
    uses short keys, so its values show in the Run Name column's width."""
    from llama_fsdp.run.spec import point_name

    spec = spec_factory(["cluster.device=cpu", "finetune=lora"])
    assert spec.run_name == "tiny lora shard=full fp32 2xcpu b8"
    assert point_name({"train.batch_size": "2", "sharding": "full"}) == "b=2 shard=full"
    assert point_name({"finetune": "qlora", "objective.beta": "0.1"}) == "ft=qlora beta=0.1"


@pytest.mark.parametrize("swept", [("finetune",), ("train.batch_size",),
                                   ("train.batch_size", "sharding")])
def test_a_sweeps_view_shows_its_swept_keys_first_and_on_the_first_screen(swept):
    """A sweep's own view: the swept keys' columns right after the run's name and start; what
    the points measured stays on the first screen (the plan's and the method's figures move
    past the duration to make room); no column twice, none lost."""
    from llama_fsdp.tracking.view import FIRST_SCREEN_PX, columns, swept_column

    cols = columns(swept)
    ids = [c for c, _ in cols]
    assert ids[2:2 + len(swept)] == [swept_column(k)[0] for k in swept]
    assert sorted(ids) == sorted(set(ids)) == sorted({c for c, _ in COLUMNS} |
                                                     {swept_column(k)[0] for k in swept})
    end = ids.index("duration") + 1
    assert sum(w for _, w in cols[:end]) <= FIRST_SCREEN_PX
    for measured in ("final loss", "eval loss", "tokens per sec", "MFU pct", "peak GB"):
        assert f"metrics.`{measured}`" in ids[:end], measured
    # a swept key's column: its param, a swept group's tag, the method's own column
    assert swept_column("train.batch_size")[0] == "params.`train.batch_size`"
    assert swept_column("sharding")[0] == "tags.`point.sharding`"
    assert swept_column("finetune")[0] == "params.`finetune.method`"


def test_a_sweep_gets_its_own_view_and_its_link_opens_it(tmp_path):
    """The sweep's parent run makes the experiment's tag of the sweep's view (its runs alone,
    the swept keys first); the sweep's page opens that view; the parent's row shows the values
    swept. A sweep whose experiment lacks the view (an earlier version's) opens the
    experiment's."""
    from mlflow.tracking import MlflowClient

    from llama_fsdp.tracking.sweep import start_parent, sweep_id_for, sweep_page

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sweep_dir = tmp_path / "sweeps" / "2026-11-28" / "12-00-00"
    sweep_dir.mkdir(parents=True)
    start_parent(str(sweep_dir), uri=uri, experiment="llama_fsdp", command="python -m llama_fsdp",
                 swept={"train.batch_size": "1,2,4", "sharding": "full,hybrid"}, points=6)
    sweep_id = sweep_id_for(str(sweep_dir))
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("llama_fsdp")
    view = json.loads(exp.tags[f"mlflow.sharedViewState.{sweep_id}"])
    state = json.loads(view["state"])
    assert state["searchFilter"] == f"tags.sweep_id = '{sweep_id}'"
    assert state["columnOrder"][2:4] == ["params.`train.batch_size`", "tags.`point.sharding`"]
    assert sweep_page(uri, "llama_fsdp", sweep_id).endswith(
        f"/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning&"
        f"viewStateShareKey={sweep_id}")
    assert sweep_page(uri, "llama_fsdp", "sweep-elsewhere").endswith(RUNS_QUERY)
    (parent,) = client.search_runs([exp.experiment_id])
    assert parent.data.params["train.batch_size"] == "1,2,4"
    assert parent.data.tags["point.sharding"] == "full,hybrid"


def test_dpos_loss_has_names_and_charts_of_its_own_and_the_sweep_reads_it_back(tmp_path):
    """A DPO run's loss (ln 2 at the start) goes to MLflow as dpo_loss, eval_dpo_loss and
    summary/*_dpo_loss, each with a chart of its own, never on SFT's loss chart; an SFT run's
    keeps the generic names; a sweep's table and best point read DPO's as the generic ones."""
    from types import SimpleNamespace

    from llama_fsdp.config.metrics import canonical
    from llama_fsdp.config.objectives import OBJECTIVES
    from llama_fsdp.tracking import Spool, events
    from llama_fsdp.tracking.tracker import Tracker

    step = {"loss": 0.69, "eval_loss": 0.7, "summary/eval_loss": 0.68, "rewards/accuracy": 0.5}
    logged = {}
    for name in ("sft", "dpo"):
        t = Tracker(str(tmp_path / name), "sqlite:///unused.db", ship=False,
                    logged_as=OBJECTIVES[name].logged_as)
        t.log_metrics(step, step=1)
        (logged[name],) = [e.metrics for e in Spool(tmp_path / name).events()
                           if isinstance(e, events.Metrics)]
    assert logged["sft"] == step
    assert logged["dpo"] == {"dpo_loss": 0.69, "eval_dpo_loss": 0.7,
                             "summary/eval_dpo_loss": 0.68, "rewards/accuracy": 0.5}
    charts = {c["metricKey"]: c for c in view_state()["compareRunCharts"] if not c["deleted"]}
    for key in ("dpo_loss", "eval_dpo_loss"):
        assert charts[key]["type"] == "LINE" and charts[key]["metricSectionId"].endswith(
            "Model metrics")
    assert charts["summary/eval_dpo_loss"]["type"] == "BAR"
    run = SimpleNamespace(data=SimpleNamespace(metrics=logged["dpo"]))
    assert Best().value(run) == 0.68  # summary/eval_loss, the default best metric
    assert canonical(logged["dpo"])["loss"] == 0.69
