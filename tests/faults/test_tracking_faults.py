"""Tracking never stops training: a real MLflow server that dies mid-run or is not there at
launch, and eight jobs writing one sqlite store at once."""
from __future__ import annotations

import functools
import multiprocessing as mp
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from llama_fsdp.launchers.environment import free_port
from llama_fsdp.tracking import read_run_file
from tests.faults import hooks
from tests.faults.conftest import logged_steps, run_dir, wait_for_step
from tests.faults import conftest as faults

# a fault in the run's state, not in how its processes start or end: the command forked warm
run_cli = functools.partial(faults.run_cli, warm=True)
start_cli = functools.partial(faults.start_cli, warm=True)


def _replay(run) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llama_fsdp.tracking", str(run),
                           "--timeout", "120"], capture_output=True, text=True, timeout=180)


def _loss_steps(uri: str, run_id: str) -> list[int]:
    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, "loss"))


@pytest.mark.slow
def test_server_dies_mid_run_training_goes_on_and_nothing_is_lost(tmp_path, mlflow_server):
    steps = 24
    mlflow_server.start()
    proc = start_cli(tmp_path, f"tracking.uri={mlflow_server.uri}", f"train.max_steps={steps}",
                     "tracking.final_delivery_s=3", "train.callbacks=[tests.faults.hooks:slow]",
                     env={hooks.SLOW: "0.2"})
    run = wait_for_step(tmp_path, 5, proc)
    mlflow_server.kill()  # as a crash: SIGKILL to the server's process group
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "status         finished" in out and f"steps          {steps}" in out
    assert "is not answering" in out  # rank 0 said so once, and trained on
    assert f"python -m llama_fsdp.tracking {run}" in out  # how to deliver the rest
    assert sorted(logged_steps(run)) == list(range(1, steps + 1))
    run_id = read_run_file(run)["run_id"]
    mlflow_server.start()  # back, on the same port and store
    replay = _replay(run)
    assert replay.returncode == 0, replay.stderr
    assert _loss_steps(mlflow_server.uri, run_id) == list(range(1, steps + 1))
    r = MlflowClient(mlflow_server.uri).get_run(run_id)
    assert r.info.status == "FINISHED" and "summary/tokens_per_sec" in r.data.metrics


# Refused by one probe without retries (tracking.FAST_FAIL_ENV): a few seconds, most of them
# Python's start and the config's composition. MLflow's own retries, the regression this guards
# against, take minutes; 60 s leaves a loaded CI machine room.
REFUSED_WITHIN_S = 60


def test_unreachable_server_is_refused_in_seconds_before_any_rank(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code, out, seconds = run_cli(tmp_path, f"tracking.uri={uri}", timeout=2 * REFUSED_WITHIN_S)
    print(f"refused in {seconds:.1f}s")
    assert code == 2, out[-3000:]
    assert seconds < REFUSED_WITHIN_S, f"refused after {seconds:.0f} s\n{out[-3000:]}"
    assert f"the MLflow tracking store {uri} does not answer" in out
    assert "tracking.allow_offline=true" in out and "tracking.enabled=false" in out
    assert not (tmp_path / "outputs" / "runs").exists()  # no run dir, no rank started


@pytest.mark.slow
def test_allow_offline_trains_now_and_delivers_later(tmp_path, mlflow_server):
    code, out, _ = run_cli(tmp_path, f"tracking.uri={mlflow_server.uri}", "train.max_steps=4",
                           "tracking.allow_offline=true", "tracking.final_delivery_s=3",
                           timeout=300)
    assert code == 0, out[-3000:]
    assert "training anyway (tracking.allow_offline=true)" in out
    run = run_dir(tmp_path)
    assert "run_id" not in read_run_file(run)  # no MLflow run yet: everything is in the spool
    mlflow_server.start()
    replay = _replay(run)
    assert replay.returncode == 0, replay.stderr
    info = read_run_file(run)
    assert _loss_steps(mlflow_server.uri, info["run_id"]) == [1, 2, 3, 4]
    r = MlflowClient(mlflow_server.uri).get_run(info["run_id"])
    assert r.info.status == "FINISHED" and r.data.params["model.name"] == "tiny"


def _job(args) -> None:
    """One sweep point's tracking: create its run through the spool, log 200 steps of metrics
    and finish, as rank 0 of a job does."""
    out, uri, name = args
    import dataclasses

    from llama_fsdp.prepare.tracking import start_run
    from llama_fsdp.tracking import Tracker
    from tests.conftest import make_spec

    spec = dataclasses.replace(make_spec([f"tracking.uri={uri}", f"tracking.run_name={name}"],
                                         output_dir=out))
    start_run(spec, command=f"job {name}")
    tracker = Tracker(out, uri)
    for step in range(1, 201):
        tracker.log_metrics({"loss": 1.0 / step, "tokens_per_sec": 100.0 + step}, step=step)
    tracker.finish("FINISHED")


@pytest.mark.slow
def test_eight_parallel_jobs_sharing_a_sqlite_store_lose_no_metric(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    jobs = [(str(tmp_path / f"run{i}"), uri, f"point-{i}") for i in range(8)]
    with mp.get_context("spawn").Pool(8) as pool:
        pool.map(_job, jobs)
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("llama_fsdp").experiment_id])
    assert sorted(r.info.run_name for r in runs) == [f"point-{i}" for i in range(8)]
    for r in runs:
        assert r.info.status == "FINISHED"
        assert _loss_steps(uri, r.info.run_id) == list(range(1, 201))
        assert len(client.get_metric_history(r.info.run_id, "tokens_per_sec")) == 200


def test_system_metrics_that_cannot_start_do_not_stop_tracking(tmp_path, monkeypatch, caplog):
    """MLflow's monitors failing to import (as a partially initialized mlflow package once did
    on a CI run's rank 0) turn system metrics off with a warning; every metric still lands."""
    import logging

    from llama_fsdp.prepare.tracking import start_run
    from llama_fsdp.tracking import tracker as tracking
    from tests.conftest import make_spec

    class Broken:
        def __init__(self, *args, **kwargs):
            raise ImportError("cannot import name '_get_store' from partially initialized "
                              "module 'mlflow.tracking'")

    monkeypatch.setattr(tracking, "SystemSampler", Broken)
    out, uri = str(tmp_path / "run"), f"sqlite:///{tmp_path}/mlflow.db"
    spec = make_spec([f"tracking.uri={uri}"], output_dir=out)
    start_run(spec, command="job")
    with caplog.at_level(logging.WARNING, logger="llama_fsdp.tracking.tracker"):
        tracker = tracking.Tracker(out, uri, system_metrics_s=0.5)
    assert tracker.sampler is None
    assert "system metrics are off for this run" in caplog.text and "_get_store" in caplog.text
    for step in range(1, 11):
        tracker.log_metrics({"loss": 1.0 / step}, step=step)
    tracker.finish("FINISHED")
    run_id = read_run_file(out)["run_id"]
    assert _loss_steps(uri, run_id) == list(range(1, 11))


def test_delivering_from_a_wrong_directory_is_refused_and_creates_nothing(tmp_path, capsys):
    from llama_fsdp.tracking.__main__ import main

    wrong = tmp_path / "runs" / "no-such-run"
    with pytest.raises(SystemExit) as e:
        main([str(wrong)])
    assert e.value.code == 2
    assert "is not a run directory" in capsys.readouterr().err
    assert not wrong.exists() and not (tmp_path / "tracking").exists()


def test_system_samples_taken_before_the_first_step_are_logged_after_its_loss(tmp_path):
    """A first step slower than the sampling interval (a loaded CI machine, a model loading)
    made system/cpu_utilization_percentage the run's first metric, and MLflow's compare page
    plotted it by default instead of the loss. The sampler holds its samples until the run
    has logged a measured metric; none of them is lost."""
    import time

    from llama_fsdp.prepare.tracking import start_run
    from llama_fsdp.tracking.tracker import Tracker
    from tests.conftest import make_spec

    out, uri = str(tmp_path / "run"), f"sqlite:///{tmp_path}/mlflow.db"
    start_run(make_spec([f"tracking.uri={uri}"], output_dir=out), command="job")
    tracker = Tracker(out, uri, system_metrics_s=0.2)
    time.sleep(1.0)  # five samples' worth before the first step
    for step in range(1, 4):
        tracker.log_metrics({"loss": 1.0 / step}, step=step)
    tracker.finish("FINISHED")
    client = MlflowClient(uri)
    run_id = read_run_file(out)["run_id"]
    cpu = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    loss = client.get_metric_history(run_id, "loss")
    assert len(cpu) >= 5, cpu  # the samples before the first step are kept ...
    assert min(m.timestamp for m in loss) <= min(m.timestamp for m in cpu), (loss, cpu)
