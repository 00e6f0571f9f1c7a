"""A rank that crashes in a SLURM job: the job's batch script restarts every rank from the newest
checkpoint (cluster.max_restarts), within the same allocation and MLflow run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from llama_fsdp.tracking import read_run_file
from tests import warm
from tests.faults import hooks
from tests.faults.conftest import logged_losses, logged_steps

pytestmark = [pytest.mark.slow]


def test_a_crashed_rank_restarts_the_job_step_from_its_checkpoint(tmp_path, slurm_cluster):
    env = {**os.environ, **slurm_cluster.env, hooks.CRASH: "rank=1,step=3",
           hooks.MARK: str(tmp_path / "fired")}
    out = subprocess.run(
        [warm.python(), "-m", "llama_fsdp", "cluster=slurm",
         f"cluster.partition={slurm_cluster.partition}", "cluster.nodes=2",
         "cluster.nproc_per_node=1", "cluster.wait=true", "cluster.max_restarts=1",
         "train.max_steps=6", "save.every_steps=2", "eval.every_steps=0", "eval.task_prompts=0",
         "train.warmup_steps=1", "train.callbacks=[tests.faults.hooks:crash]"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:] + slurm_cluster.logs()
    assert "the first rank to fail:\nrank 1 on node2" in log
    assert "the job restarts its ranks from the newest checkpoint (restart 1 of 1)" in log
    run = next((tmp_path / "outputs" / "runs").glob("*/*"))
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/outputs/mlflow.db")
    r = client.get_run(read_run_file(run)["run_id"])
    assert r.info.status == "FINISHED"
    assert r.data.tags["restarts"] == "1" and r.data.tags["resume_step"] == "2"
    # 1-3 from the first attempt (3 never checkpointed), then 3-6 from step 2's state: step 3
    # trained again from that state is the first attempt's step 3, bit for bit
    logged = logged_losses(run)
    assert [s for s, _ in logged] == [1, 2, 3, 3, 4, 5, 6]
    assert logged[2] == logged[3]


def test_a_killed_waiting_launcher_leaves_the_job_to_slurm_and_its_directory_owned(
        tmp_path, slurm_cluster):
    """cluster.wait=true and the launcher SIGKILLed mid-run: the ranks are SLURM's job (not
    orphans: squeue has them, scancel ends them), and a second launch into the run's directory
    while the job lives is refused, naming the job. The job is far from its end (a step takes
    0.5 s, and there are 1000) until the test cancels it."""
    import signal
    import subprocess as sp
    import time

    from tests.faults.conftest import no_leftovers, wait_for_step

    env = {**os.environ, **slurm_cluster.env, hooks.SLOW: "0.5"}
    args = [sys.executable, "-m", "llama_fsdp", "cluster=slurm",
            f"cluster.partition={slurm_cluster.partition}", "cluster.nodes=1",
            "cluster.nproc_per_node=2", "cluster.wait=true", "train.max_steps=1000",
            "eval.every_steps=0", "eval.task_prompts=0", "train.warmup_steps=1",
            "train.callbacks=[tests.faults.hooks:slow]"]
    launcher = sp.Popen(args, cwd=tmp_path, env=env, stdout=sp.PIPE, stderr=sp.STDOUT,
                        text=True, start_new_session=True)
    run = wait_for_step(tmp_path, 3, launcher, timeout=300)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=30)
    owner = json.loads((run / "owner.json").read_text())
    job = owner["slurm_job"]

    def state() -> str:
        return sp.run(["squeue", "--noheader", "--jobs", job, "--format=%T"], env=env,
                      capture_output=True, text=True).stdout.strip()

    assert state() == "RUNNING"
    again = sp.run([*args, f"output_dir={run}"], cwd=tmp_path, env=env, capture_output=True,
                   text=True, timeout=300)
    assert again.returncode == 2, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"belongs to SLURM job {job} (RUNNING)" in again.stdout + again.stderr
    assert state() == "RUNNING"  # still far from its end: the refusal raced nothing
    sp.run(["scancel", job], env=env, check=True)
    deadline = time.monotonic() + 120
    while state() and time.monotonic() < deadline:
        time.sleep(1)
    assert not state(), f"job {job} still listed: {state()}"
    assert no_leftovers(str(tmp_path), within_s=60) == []  # its ranks ended with it
    assert max(logged_steps(run)) < 1000  # ended by scancel, not by training to its end
