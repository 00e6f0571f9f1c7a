"""A rank that dies, restarts, and signals to the launcher: on real local ranks, through the
command users type."""
from __future__ import annotations

import signal
import time

import pytest
from mlflow.tracking import MlflowClient

from llama_fsdp.tracking import read_run_file
from tests.faults import hooks
from tests.faults.conftest import (
    UNINTERRUPTED_STEPS,
    logged_losses,
    logged_steps,
    no_leftovers,
    run_cli,
    run_dir,
    start_cli,
    wait_for_step,
)

pytestmark = [pytest.mark.slow]


def test_a_killed_rank_is_named_and_the_run_restarts_from_its_checkpoint(tmp_path,
                                                                         uninterrupted):
    """SIGKILL (as the OOM killer sends it) on rank 1 after step 3: the report leads with rank
    1 and its signal; with cluster.max_restarts=1 every rank restarts from step 2's checkpoint
    and the run finishes in the same MLflow run, every loss the uninterrupted run's."""
    code, log, _ = run_cli(
        tmp_path, f"train.max_steps={UNINTERRUPTED_STEPS}", "save.every_steps=2",
        "cluster.max_restarts=1",
        "train.callbacks=[tests.faults.hooks:self_signal]",
        env={hooks.SIGNAL: "rank=1,step=3,sig=KILL", hooks.MARK: str(tmp_path / "fired")})
    assert code == 0, log[-4000:]
    first = log.index("the first rank to fail:")
    assert "rank 1 on " in log[first:first + 200]
    assert "killed by signal 9 (SIGKILL): the kernel's OOM killer" in log[first:first + 400]
    assert "restarting every rank from the newest checkpoint (restart 1 of 1)" in log
    assert "status         finished" in log
    run = run_dir(tmp_path)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/outputs/mlflow.db")
    r = client.get_run(read_run_file(run)["run_id"])
    assert r.info.status == "FINISHED" and r.data.tags["restarts"] == "1"
    assert r.data.tags["resume_step"] == "2"
    assert [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, "restart")] == [
        (2, 1.0)]
    # steps 1-3 from the first attempt (3 never checkpointed), 3-8 again from step 2's state,
    # each the loss of the same step uninterrupted
    logged = logged_losses(run)
    assert [s for s, _ in logged] == [1, 2, 3, *range(3, UNINTERRUPTED_STEPS + 1)]
    assert [loss for _, loss in logged] == [uninterrupted[s] for s, _ in logged]
    assert no_leftovers(str(tmp_path)) == []


def _start_slow(tmp_path, *extra):
    return start_cli(tmp_path, "train.max_steps=200", "train.callbacks=[tests.faults.hooks:slow]",
                     *extra, env={hooks.SLOW: "0.3"})


def test_ctrl_c_saves_a_checkpoint_and_stops_every_rank(tmp_path):
    proc = _start_slow(tmp_path, "save.every_steps=1000")
    run = wait_for_step(tmp_path, 3, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert "Ctrl-C: the ranks stop at their next log step, after saving a checkpoint" in out
    assert "status         stopped by the user" in out
    stopped = max(logged_steps(run))
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == [f"step_{stopped:06d}"]  # saved at the step where it stopped
    assert "resume=auto" in out.split("continue with")[1].splitlines()[0]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/outputs/mlflow.db")
    assert client.get_run(read_run_file(run)["run_id"]).info.status == "KILLED"
    assert no_leftovers(str(tmp_path)) == []


def test_ctrl_c_without_checkpoints_says_so_and_a_rerun_gets_its_own_mlflow_run(tmp_path):
    """save.every_steps=0: nothing to continue from. The summary says so (no "continue with"
    line), and running the same directory again starts at step 0 in a new MLflow run: the
    stopped run's steps are not logged twice into it."""
    proc = _start_slow(tmp_path, "save.every_steps=0")
    run = wait_for_step(tmp_path, 2, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert "continue with" not in out
    assert "no checkpoint  none was saved (save.every_steps=0), so this run cannot be" in out
    first = read_run_file(run)["run_id"]
    stopped = max(logged_steps(run))
    code, log, _ = run_cli(tmp_path, f"output_dir={run}", "resume=auto", "train.max_steps=3",
                           "train.warmup_steps=1")
    assert code == 0, log[-3000:]
    assert "has no checkpoint to continue from" in log
    second = read_run_file(run)["run_id"]
    assert second != first
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/outputs/mlflow.db")
    history = {r: [m.step for m in client.get_metric_history(r, "loss")] for r in (first, second)}
    assert history == {first: list(range(1, stopped + 1)), second: [1, 2, 3]}
    assert client.get_run(first).info.status == "KILLED"


@pytest.mark.parametrize("signals", [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM,),
                                     (signal.SIGHUP,)], ids=["ctrl-c-twice", "term", "hup"])
def test_the_launcher_stops_every_rank_at_once(tmp_path, signals):
    proc = _start_slow(tmp_path, "save.every_steps=0")
    wait_for_step(tmp_path, 2, proc)
    t0 = time.monotonic()
    for sig in signals:
        proc.send_signal(sig)
        time.sleep(0.3)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signals[-1], out[-3000:]
    assert f"stopped by {signals[-1].name}: every rank of job" in out
    assert no_leftovers(str(tmp_path)) == [], f"still running {time.monotonic() - t0:.1f}s later"
