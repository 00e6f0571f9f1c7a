"""No process of a run outlives the process that waits for it, a dead supervisor is named like a
dead rank, and a run directory has one live owner: real processes, real signals."""
from __future__ import annotations

import signal
import time

import psutil
import pytest
from mlflow.tracking import MlflowClient

from llama_fsdp.checkpoint.layout import latest_checkpoint, verify
from llama_fsdp.tracking import read_run_file
from tests.faults import hooks
from tests.faults.conftest import (
    UNINTERRUPTED_STEPS,
    leftovers,
    logged_losses,
    logged_steps,
    no_leftovers,
    run_cli,
    start_cli,
    wait_for_step,
)

pytestmark = [pytest.mark.slow]


def _start_slow(tmp_path, *extra, sleep="0.3"):
    return start_cli(tmp_path, "train.max_steps=200", "train.callbacks=[tests.faults.hooks:slow]",
                     *extra, env={hooks.SLOW: sleep})


def _supervisor(tmp_path, rank: int) -> psutil.Process:
    """The submitit task (rank supervisor) of ``rank`` under this test's directory: a child of
    the local controller (forked from it: launchers/forked.py) whose standard output is
    submitit's log of that task, <job>_<rank>_log.out."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "llama_fsdp.launchers.controller" in cmd and str(tmp_path) in cmd:
            for child in p.children():
                if any(f.path.endswith(f"_{rank}_log.out") and f.fd == 1
                       for f in child.open_files()):
                    return child
    raise AssertionError(f"no supervisor of rank {rank}: {leftovers(str(tmp_path))}")


def test_a_launcher_killed_with_sigkill_takes_every_rank_with_it(tmp_path):
    """SIGKILL to the launcher (the OOM killer, `timeout -s KILL`): the controller, both
    supervisors and both training processes are gone within seconds, and the newest complete
    checkpoint is intact."""
    proc = _start_slow(tmp_path, "save.every_steps=2")
    run = wait_for_step(tmp_path, 5, proc)
    assert len(leftovers(str(tmp_path))) >= 5  # launcher, controller, 2 x (supervisor, rank)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert no_leftovers(str(tmp_path), within_s=15) == []
    gone = time.monotonic() - t0
    assert gone < 15, gone
    newest = latest_checkpoint(run)
    assert newest is not None and verify(newest) is None


def test_a_killed_supervisor_is_named_and_the_run_restarts_from_its_checkpoint(tmp_path,
                                                                               uninterrupted):
    proc = _start_slow(tmp_path, "save.every_steps=2", "cluster.max_restarts=1",
                       f"train.max_steps={UNINTERRUPTED_STEPS}", sleep="0.5")
    run = wait_for_step(tmp_path, 3, proc)
    victim = _supervisor(tmp_path, 1)
    t0 = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    first = out.index("the first rank to fail:")
    assert "rank 1's supervisor on " in out[first:first + 300]
    assert f"(pid {victim.pid}): killed by signal 9 (SIGKILL)" in out[first:first + 400]
    assert "restarting every rank from the newest checkpoint (restart 1 of 1)" in out
    assert "status         finished" in out
    r = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/outputs/mlflow.db").get_run(
        read_run_file(run)["run_id"])
    assert r.info.status == "FINISHED" and r.data.tags["restarts"] == "1"
    # the first attempt logged 1..k (k >= 3: killed after step 3); the restart resumed from a
    # checkpoint after step 0 and logged on from there, every loss the uninterrupted run's
    resumed = int(r.data.tags["resume_step"])
    logged = logged_losses(run)
    steps = [s for s, _ in logged]
    k = len(steps) - (UNINTERRUPTED_STEPS - resumed)
    assert 2 <= resumed <= k and k >= 3, (resumed, steps)
    assert steps == [*range(1, k + 1), *range(resumed + 1, UNINTERRUPTED_STEPS + 1)]
    assert [loss for _, loss in logged] == [uninterrupted[s] for s in steps]
    assert no_leftovers(str(tmp_path)) == [], f"{time.monotonic() - t0:.0f}s after the kill"


def test_a_second_launch_into_a_live_run_directory_is_refused_at_once(tmp_path):
    proc = _start_slow(tmp_path, "save.every_steps=0", "train.max_steps=30")
    run = wait_for_step(tmp_path, 2, proc)
    code, out, _ = run_cli(tmp_path, f"output_dir={run}", "train.max_steps=30", timeout=120)
    assert code == 2, out[-3000:]
    assert f"{run} is in use by a live launch: pid {proc.pid} on " in out
    # refused before any work on the run: no data prepared, no MLflow run touched, no rank
    # started (what the second launch printed, not how long it took)
    assert proc.poll() is None  # the owner was live throughout
    for step in ("data ready in", "continuing MLflow run", "local rank(s)", "[rank"):
        assert step not in out, (step, out[-3000:])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "status         finished" in out, out[-3000:]


def test_a_dead_owner_is_taken_over_and_a_finished_run_starts_nothing(tmp_path):
    """The owner is SIGKILLed (its lock dies with it): the next launch takes the directory over
    and resumes from the newest checkpoint. Launched again once finished, it starts nothing,
    unless train.max_steps grew."""
    proc = _start_slow(tmp_path, "save.every_steps=2", "train.max_steps=8")
    run = wait_for_step(tmp_path, 3, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert no_leftovers(str(tmp_path), within_s=15) == []
    code, out, _ = run_cli(tmp_path, f"output_dir={run}", "train.max_steps=8")
    assert code == 0, out[-3000:]
    assert f"(pid {proc.pid} on " in out and "taking it over; resume=auto continues from its " \
                                             "newest checkpoint" in out
    assert "resumed from" in out and "status         finished" in out
    code, out, seconds = run_cli(tmp_path, f"output_dir={run}", "train.max_steps=8")
    assert code == 0, out[-3000:]
    assert "this run finished at step 8 (train.max_steps=8)" in out and "nothing launched" in out
    assert "started" not in out and "local rank(s)" not in out
    code, out, _ = run_cli(tmp_path, f"output_dir={run}", "train.max_steps=10")
    assert code == 0 and "status         finished" in out and "steps          10" in out, \
        out[-3000:]
