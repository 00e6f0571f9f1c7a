"""Jobs SLURM takes back into its queue, on the real test cluster: an admin's `scontrol requeue`
while the job trains (the launcher waiting for it, and not), and a preemption by a job of a
higher-priority partition, which sends SIGTERM and kills after the partition's GraceTime.

A requeued job is no failed job: it runs again from its newest checkpoint, and its MLflow run
shows every step once."""
from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from llama_fsdp.tracking import read_run_file
from tests import warm
from tests.faults import hooks

from .conftest import PREEMPT_GRACE_S

pytestmark = [pytest.mark.slow]

FAST = ["eval.every_steps=0", "eval.task_prompts=0", "train.warmup_steps=1"]


def _args(cluster, partition: str, *overrides: str) -> list[str]:
    return [warm.python(), "-m", "llama_fsdp", "cluster=slurm", f"cluster.partition={partition}",
            *FAST, *overrides]


def _env(cluster, **extra: str) -> dict[str, str]:
    return {**os.environ, **cluster.env, **extra}


def _client(cwd: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{cwd}/outputs/mlflow.db")


def _run_dir(cwd: Path, timeout: float = 120) -> Path:
    deadline = time.monotonic() + timeout
    while not (dirs := sorted((cwd / "outputs" / "runs").glob("*/*"))):
        assert time.monotonic() < deadline, f"no run directory under {cwd}"
        time.sleep(0.5)
    return dirs[0]


def _job_and_run(cwd: Path, timeout: float = 180) -> tuple[str, str]:
    """The run's SLURM job id and MLflow run id, once both exist."""
    run, deadline = _run_dir(cwd), time.monotonic() + timeout
    while True:
        job = (_read_json(run / "owner.json") or {}).get("slurm_job")
        run_id = read_run_file(run).get("run_id")
        if job and run_id:
            return str(job), run_id
        assert time.monotonic() < deadline, f"no job or MLflow run for {run}"
        time.sleep(0.5)


def _read_json(path: Path) -> dict | None:
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _losses(client: MlflowClient, run_id: str):
    return client.get_metric_history(run_id, "loss")


def _wait_losses(client: MlflowClient, run_id: str, n: int, cluster, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while len(_losses(client, run_id)) < n:
        assert time.monotonic() < deadline, (f"fewer than {n} losses in {timeout:.0f}s\n"
                                             + cluster.logs())
        time.sleep(0.5)


def _wait_status(client: MlflowClient, run_id: str, status: str, timeout: float):
    """The run once MLflow says ``status``; a run that failed meanwhile fails the test."""
    deadline = time.monotonic() + timeout
    while (run := client.get_run(run_id)).info.status != status:
        assert run.info.status != "FAILED", (run.info.status, run.data.tags)
        assert time.monotonic() < deadline, (run.info.status, run.data.tags)
        time.sleep(1)
    return run


def _every_step_once(client: MlflowClient, run_id: str, steps: int) -> list:
    history = sorted(_losses(client, run_id), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(1, steps + 1)), [m.step for m in history]
    return history


def _slurm_record(job: str, env: dict[str, str]) -> tuple[str, list[str]]:
    """SLURM's own word on a job: its Restarts count (scontrol, which keeps an ended job for
    MinJobAge) and the states of its every attempt, oldest first (sacct --duplicates: a
    requeued attempt's record stays, as REQUEUED)."""
    shown = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True,
                           text=True, check=True, timeout=30).stdout
    restarts = re.search(r"\bRestarts=(\d+)", shown)
    states = subprocess.run(["sacct", "-j", job, "--duplicates", "-X", "-n", "-P", "-o", "State"],
                            env=env, capture_output=True, text=True, check=True,
                            timeout=30).stdout.split()
    return (restarts.group(1) if restarts else shown), states


# the requeue test's runs: steps, a checkpoint every SAVE_EVERY, and a stall after STALL_AT in
# the first attempt (every rank sleeps there), where `scontrol requeue` finds them: steps
# SAVE_EVERY+1..STALL_AT are logged and never checkpointed, and the requeued job trains them
# again (SLURM kills the stalled ranks after KillWait, 5 s: they never reach a log step to save)
REQUEUE_STEPS, SAVE_EVERY, STALL_AT = 8, 3, 5


def test_requeued_jobs_run_again_and_log_every_step_once(tmp_path, slurm_cluster):
    """`scontrol requeue` of two jobs mid-run, one whose launcher waits (cluster.wait=true) and
    one that returned at submission. Before: the waiting launcher called the job failed
    ("killed by signal 15") and cancelled it (exit 1, MLflow FAILED); the other's run showed
    FAILED while it waited, then logged its replayed steps a second time (and its ~30 step-0
    setup metrics). Now both finish, exit 0, each step once, the replayed ones from the
    attempt that counts, and the queued run says "requeued"."""
    common = ["cluster.nodes=1", f"train.max_steps={REQUEUE_STEPS}",
              f"save.every_steps={SAVE_EVERY}", "train.callbacks=[tests.faults.hooks:stall]"]
    env = _env(slurm_cluster, **{hooks.STALL: f"step={STALL_AT},seconds=300"})
    waiting_cwd, detached_cwd = tmp_path / "waiting", tmp_path / "detached"
    waiting_cwd.mkdir(), detached_cwd.mkdir()
    t0 = time.monotonic()
    waiting = subprocess.Popen(
        _args(slurm_cluster, slurm_cluster.partition, *common, "cluster.nproc_per_node=2",
              "cluster.wait=true"), cwd=waiting_cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        detached = subprocess.run(
            _args(slurm_cluster, slurm_cluster.partition, *common, "cluster.nproc_per_node=1",
                  "cluster.wait=false"), cwd=detached_cwd, env=env, capture_output=True,
            text=True, timeout=300)
        assert detached.returncode == 0, detached.stderr[-3000:]
        runs = {cwd: _job_and_run(cwd) for cwd in (waiting_cwd, detached_cwd)}
        clients = {cwd: _client(cwd) for cwd in runs}
        for cwd, (_, run_id) in runs.items():  # both stalled after STALL_AT
            _wait_losses(clients[cwd], run_id, STALL_AT, slurm_cluster)
        requeued_at_ms = int(time.time() * 1000)
        subprocess.run(["scontrol", "requeue", ",".join(job for job, _ in runs.values())],
                       env=env, check=True, timeout=30)
        # while the job waits in the queue, its MLflow run says so (SCHEDULED, "requeued")
        for cwd, (_, run_id) in runs.items():
            deadline = time.monotonic() + 60
            while not ((r := clients[cwd].get_run(run_id)).data.tags.get("status") == "requeued"
                       and r.info.status == "SCHEDULED"):
                assert r.info.status != "FAILED" and time.monotonic() < deadline, (
                    r.info.status, r.data.tags.get("status"))
                time.sleep(0.25)
        out, _ = waiting.communicate(timeout=420)
    finally:
        if waiting.poll() is None:
            os.killpg(waiting.pid, 9)
    assert waiting.returncode == 0, out[-5000:] + slurm_cluster.logs()
    job = runs[waiting_cwd][0]
    assert f"job {job} was requeued by SLURM (restart 1" in out, out[-5000:]
    assert f"job {job} failed" not in out and "cancelled" not in out, out[-5000:]
    assert "could not be delivered" not in out and "not in MLflow" not in out, out[-5000:]
    for cwd, (job, run_id) in runs.items():
        client = clients[cwd]
        run = _wait_status(client, run_id, "FINISHED", timeout=300)
        history = _every_step_once(client, run_id, REQUEUE_STEPS)
        # the steps trained again after the requeue are the ones shown: logged after it
        assert all(m.timestamp >= requeued_at_ms for m in history[SAVE_EVERY:STALL_AT]), history
        assert all(m.timestamp < requeued_at_ms for m in history[:SAVE_EVERY]), history
        assert run.data.tags["restarts"] == "1" and run.data.tags["resume_step"] == str(SAVE_EVERY)
        assert len(client.get_metric_history(run_id, "global_batch")) == 1  # setup logged once
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, "restart")] == [
            (SAVE_EVERY, 1.0)]
        assert run.data.tags["status"] == "finished"
        # and SLURM says so too: one restart, an attempt requeued, then the one that completed
        # (SLURM's record of the job's end can follow the run's by a few seconds: RUNNING, or
        # COMPLETING, while the job step's processes are reaped)
        deadline = time.monotonic() + 60
        while (record := _slurm_record(job, env))[1][-1:] in (["RUNNING"], ["COMPLETING"]):
            assert time.monotonic() < deadline, (job, record)
            time.sleep(1)
        assert record == ("1", ["REQUEUED", "COMPLETED"]), job
    print(f"two requeued jobs, both finished: {time.monotonic() - t0:.0f}s")


PREEMPT_STEPS, SIGNAL_AT, PREEMPT_STEP_SLEEP_S = 20, 6, 0.75


def test_a_preempted_job_saves_within_its_grace_time_and_resumes_there(tmp_path, slurm_cluster):
    """A job of partition `urgent` preempts the run's job in `preemptible` (GraceTime 30 s):
    SLURM sends SIGTERM, and SIGKILL once the grace time is over. The ranks save a checkpoint at
    their next log step, rank 0 requeues the job (one whose ranks end within the grace time is
    over, never requeued: lost), and the requeued job resumes from that checkpoint. Before: the
    ranks died of the SIGTERM at once, and the run was lost (MLflow FAILED)."""
    # the only checkpoints: the one the signal makes, and the last. The first attempt is paced
    # (PREEMPT_STEP_SLEEP_S a step), so that the steps it has left when the signal goes out (at
    # SIGNAL_AT losses) take 10 s at least, however fast the node; the resumed one is not
    steps, every = PREEMPT_STEPS, 100
    t0 = time.monotonic()
    out = subprocess.run(
        _args(slurm_cluster, "preemptible", "cluster.nodes=1", "cluster.nproc_per_node=2",
              f"train.max_steps={steps}", f"save.every_steps={every}", "cluster.wait=false",
              "train.callbacks=[tests.faults.hooks:slow]"), cwd=tmp_path,
        env=_env(slurm_cluster, **{hooks.SLOW: str(PREEMPT_STEP_SLEEP_S), hooks.SLOW_FIRST: "1"}),
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    job, run_id = _job_and_run(tmp_path)
    client = _client(tmp_path)
    _wait_losses(client, run_id, SIGNAL_AT, slurm_cluster)
    env = _env(slurm_cluster)
    node = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()
    signalled_at = int(time.time() * 1000)
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-w", node, "-n", "1", "-c",
                             str(slurm_cluster.cpus_per_node), "-o", str(tmp_path / "urgent.out"),
                             "--wrap", "sleep 1"], env=env, capture_output=True, text=True,
                            check=True).stdout.strip()
    run = _wait_status(client, run_id, "FINISHED", timeout=420)
    resume_step = int(run.data.tags["resume_step"])
    assert SIGNAL_AT <= resume_step < steps and run.data.tags["restarts"] == "1"
    ckpts = sorted(p.name for p in Path(run.data.tags["output_dir"], "checkpoints").iterdir())
    assert ckpts == [f"step_{resume_step:06d}", f"step_{steps:06d}"]  # saved at the signal
    history = _every_step_once(client, run_id, steps)
    assert all(m.timestamp < signalled_at + PREEMPT_GRACE_S * 1000
               for m in history[:resume_step])  # within the grace time
    logs = "".join(p.read_text(errors="replace") for p in
                   Path(run.data.tags["output_dir"], "submitit").rglob("*_0_log.*"))
    assert f"preempted: saving a checkpoint at step {resume_step}" in logs, logs[-3000:]
    states = [r.get("State") for r in slurm_cluster.sacct(urgent)]
    deadline = time.monotonic() + 60
    while "COMPLETED" not in states:  # the urgent job got the node
        assert time.monotonic() < deadline, states
        time.sleep(1)
        states = [r.get("State") for r in slurm_cluster.sacct(urgent)]
    print(f"preempted job saved at step {resume_step}, finished: {time.monotonic() - t0:.0f}s")
