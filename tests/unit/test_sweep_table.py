"""The sweep summary table: the swept keys are columns even when only one point ran, and a
point refused before it launched (no MLflow run) still has its row."""
from __future__ import annotations

import pytest

from llama_fsdp.tracking.sweep import format_table, summary_rows


@pytest.fixture
def _run(tmp_path):
    """Real runs in a sqlite MLflow store, as the summary reads them (search_runs)."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.create_experiment("sweep")

    def make(params: dict, metrics: dict, status: str = "FINISHED", *, name: str = "",
             output_dir: str = "", start: int = 0, point: dict | None = None):
        from llama_fsdp.tracking.sweep import point_tags

        run = client.create_run(exp, start_time=start, run_name=name,
                                tags={"output_dir": output_dir or name,
                                      **point_tags(point or {})})
        client.log_batch(run.info.run_id, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()],
                         params=[Param(k, v) for k, v in params.items()])
        client.set_terminated(run.info.run_id, status=status)
        return client.get_run(run.info.run_id)

    return make


def test_a_refused_point_has_a_row_and_the_swept_key_stays_a_column(_run):
    ran = _run({"train.batch_size": "2", "train.lr": "0.001"},
               {"summary/tokens_per_sec": 2942.0, "summary/final_loss": 0.8209})
    keys, rows = summary_rows([ran], ["train.batch_size"], [({"train.batch_size": "0"}, 2)])
    assert keys == ["train.batch_size"]
    assert [(r["train.batch_size"], r["status"]) for r in rows] == [
        ("2", "FINISHED"), ("0", "REFUSED (exit 2)")]
    table = format_table(keys, rows).splitlines()
    assert table[0].split()[0] == "train.batch_size"
    assert table[2].split()[0] == "2" and table[3].split() == ["0", "-", "-", "-", "REFUSED",
                                                               "(exit", "2)"]


def test_keys_that_differ_between_points_are_columns_too(_run):
    a = _run({"train.batch_size": "2", "sharding.strategy": "full"}, {})
    b = _run({"train.batch_size": "4", "sharding.strategy": "full"}, {})
    keys, rows = summary_rows([b, a])
    assert keys == ["train.batch_size"] and [r["train.batch_size"] for r in rows] == ["2", "4"]


def test_a_swept_config_group_shows_its_choice_or_the_keys_it_changed(_run):
    """sharding=full,grad_op: the children hold sharding.strategy, not "sharding"."""
    a = _run({"sharding.strategy": "full"}, {}, name="sharding=full", point={"sharding": "full"})
    b = _run({"sharding.strategy": "grad_op"}, {}, name="sharding=grad_op",
             point={"sharding": "grad_op"})
    keys, rows = summary_rows([a, b], ["sharding"])
    assert keys == ["sharding.strategy"]
    # a group whose choice changes no other param: its column comes from the points' values
    c = _run({"train.lr": "0.1"}, {}, name="precision=bf16", point={"precision": "bf16"})
    d = _run({"train.lr": "0.1"}, {}, name="precision=fp32", point={"precision": "fp32"})
    keys, rows = summary_rows([d, c], ["precision"])
    assert keys == ["precision"] and [r["precision"] for r in rows] == ["bf16", "fp32"]


def test_a_point_run_again_is_summarized_by_its_newest_run(_run):
    from llama_fsdp.tracking.sweep import _latest_per_point

    old = _run({}, {}, "FAILED", name="batch_size=2", output_dir="/s/0", start=1)
    new = _run({}, {}, "FINISHED", name="batch_size=2", output_dir="/s/0", start=5)
    other = _run({}, {}, "FINISHED", name="batch_size=4", output_dir="/s/1", start=2)
    assert sorted((r.info.run_name, r.info.start_time)
                  for r in _latest_per_point([new, other, old])) == [
        ("batch_size=2", 5), ("batch_size=4", 2)]


def test_a_point_is_skipped_only_if_this_config_finished(tmp_path):
    """run_status.json records the config that finished: an attempt with another config that
    died before training (config.yaml rewritten, status left from before) is not skipped."""
    import dataclasses

    from llama_fsdp.cli.multirun import finished_point as _finished_point
    from llama_fsdp.config.rundir import write_run_status
    from tests.conftest import make_spec

    spec = dataclasses.replace(make_spec(["train.max_steps=3", "train.warmup_steps=1"],
                                         output_dir=tmp_path), sweep_id="sweep-x")
    changed = dataclasses.replace(make_spec(["train.max_steps=6", "train.warmup_steps=1"],
                                            output_dir=tmp_path), sweep_id="sweep-x")
    assert not _finished_point(spec)  # never ran
    write_run_status(tmp_path, status="stopped by the user", step=2, config_yaml=spec.config_yaml)
    assert not _finished_point(spec)
    write_run_status(tmp_path, status="finished", step=3, config_yaml=spec.config_yaml)
    assert _finished_point(spec) and not _finished_point(changed)
    assert not _finished_point(dataclasses.replace(spec, sweep_id=None))  # single runs: never


def test_overrides_are_read_with_hydras_parser_a_list_is_no_sweep():
    """cluster.setup=[a,b] is one value (a list), not two points; train.batch_size=1,2 and
    +precision=bf16,fp32 are sweeps; a refused point keeps its group's choice for a key of the
    group (sharding.strategy from sharding=grad_op)."""
    from llama_fsdp.cli.overrides import command_line, point_values, swept_overrides

    args = ["train.batch_size=1,2", "cluster.setup=[module load cuda,echo hi]",
            "+precision=bf16,fp32", "sharding=grad_op", "train.lr=range(1,3)"]
    assert swept_overrides(args) == {"train.batch_size": "1,2", "precision": "bf16,fp32",
                                     "train.lr": "1,2"}
    point = ["train.batch_size=2", "cluster.setup=[module load cuda,echo hi]", "sharding=grad_op"]
    assert point_values(point, ["train.batch_size", "sharding"]) == {
        "train.batch_size": "2", "sharding": "grad_op"}
    assert point_values(["cluster.setup=[a,b]"], None) == {"cluster.setup": "[a,b]"}
    keys, rows = summary_rows([], ["train.batch_size", "sharding.strategy"],
                              [({"train.batch_size": "2", "sharding": "grad_op"}, 2)])
    assert [rows[0][k] for k in keys] == ["grad_op", "2"]
    import sys
    argv, sys.argv = sys.argv, ["llama-fsdp", "-m", "output_dir=/x", "resume=auto",
                                "train.lr=0.1"]
    try:
        assert command_line(drop=("output_dir", "resume")) == "llama-fsdp -m train.lr=0.1"
    finally:
        sys.argv = argv


@pytest.mark.parametrize("swept, best, by", [
    # batch size and sharding only, run for speed: the fastest point
    ({"train.batch_size": ["2", "4"], "sharding": ["full", "grad_op"]}, "fast",
     "highest summary/tokens_per_sec (no eval loss, only systems keys swept)"),
    # the learning rate changes what is learned: the lowest final loss
    ({"train.lr": ["0.001", "0.01"]}, "low-loss", "lowest summary/final_loss (no eval loss)"),
])
def test_a_sweep_without_eval_still_has_a_best_point_and_says_which_rule_chose_it(
        tmp_path, swept, best, by):
    """Issue 62: a sweep with eval.every_steps=0 ended with "best point: none yet" and a parent
    without numbers. The summary on a real store (parent and children as a sweep makes them)
    now picks one by what the points can be compared on, and says how."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from llama_fsdp.tracking.sweep import KIND_TAG, summarize

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("llama_fsdp")
    parent = client.create_run(exp, run_name="sweep", tags={"sweep_id": "sweep-a_b",
                                                             KIND_TAG: "sweep"})
    client.log_batch(parent.info.run_id,
                     params=[Param(k, ",".join(v)) for k, v in swept.items()])
    for name, tokens, loss in [("fast", 3000.0, 0.9), ("low-loss", 1000.0, 0.5)]:
        run = client.create_run(exp, run_name=name,
                                tags={"mlflow.parentRunId": parent.info.run_id,
                                      "output_dir": name})
        client.log_batch(run.info.run_id, params=[
            Param(k, v[0] if name == "fast" else v[1]) for k, v in swept.items()],
            metrics=[Metric("summary/tokens_per_sec", tokens, 0, 0),
                     Metric("summary/final_loss", loss, 0, 0)])
        client.set_terminated(run.info.run_id)
    table = summarize("sweep-a_b", tracking_uri=uri, experiment="llama_fsdp")
    assert table.splitlines()[-1].startswith(f"best point: {best} (")
    assert table.splitlines()[-1].endswith(by.split(" (")[1].rstrip(")") + ")")
    tags = client.get_run(parent.info.run_id).data.tags
    assert tags["best point"] == best and tags["best by"] == by
    metric = by.split()[1].removeprefix("summary/")
    assert f"best/{metric}" in client.get_run(parent.info.run_id).data.metrics


def test_a_resumed_search_keeps_the_refused_trials_it_does_not_run_again(tmp_path):
    """A grid run again re-refuses its refused points (and reports them anew); a search does
    not ask a told trial again, so its rerun keeps the refused rows recorded on the parent."""
    from mlflow.tracking import MlflowClient

    from llama_fsdp.tracking.sweep import KIND_TAG, summarize

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("llama_fsdp")
    parent = client.create_run(exp, run_name="sweep", tags={"sweep_id": "sweep-a_b",
                                                             KIND_TAG: "sweep"})
    client.log_param(parent.info.run_id, "train.lr", "choice(-1, -2, 0.003)")
    first = summarize("sweep-a_b", tracking_uri=uri, experiment="llama_fsdp",
                      parent_id=parent.info.run_id, refused=[({"train.lr": "-1"}, 2)])
    assert "REFUSED (exit 2)" in first
    again = summarize("sweep-a_b", tracking_uri=uri, experiment="llama_fsdp",
                      parent_id=parent.info.run_id, refused=[({"train.lr": "-2"}, 2)],
                      keep_refused=True)
    assert [line.split()[0] for line in again.splitlines() if "REFUSED" in line] == ["-1", "-2"]
