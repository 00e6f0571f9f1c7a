"""`cluster=slurm` end to end on a real SLURM cluster (2 nodes, each its own network namespace).

The command is the one users type; the cluster comes from the `slurm_cluster` fixture.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests import warm

pytestmark = [pytest.mark.slow]

FAST = ["eval.every_steps=0", "eval.task_prompts=0", "train.warmup_steps=1"]


def _cli(cwd: Path, cluster, *overrides: str, env_extra: dict | None = None, timeout: int = 600):
    env = {**os.environ, **cluster.env, **(env_extra or {})}
    flags = [o for o in overrides if o.startswith("-")]  # Hydra wants flags before overrides
    rest = [o for o in overrides if not o.startswith("-")]
    return subprocess.run([warm.python(), "-m", "llama_fsdp", *flags, "cluster=slurm",
                           f"cluster.partition={cluster.partition}", *rest],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _client(cwd: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{cwd}/outputs/mlflow.db")


def _runs(cwd: Path):
    client = _client(cwd)
    exp = client.get_experiment_by_name("llama_fsdp")
    return client, (client.search_runs([exp.experiment_id]) if exp else [])


def test_two_nodes_hybrid_job_places_ranks_per_node(tmp_path, slurm_cluster):
    out = _cli(tmp_path, slurm_cluster, "cluster.nodes=2", "cluster.nproc_per_node=2",
               "sharding=hybrid", "cluster.wait=true", "train.max_steps=4", "train.batch_size=4",
               *FAST)
    assert out.returncode == 0, out.stderr[-4000:] + slurm_cluster.logs()
    assert "submitted SLURM job" in out.stdout + out.stderr
    client, runs = _runs(tmp_path)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run = runs[0]
    hosts = run.data.tags["rank_hosts"].split(",")
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3] and hosts[0] != hosts[2]
    assert set(hosts) == set(slurm_cluster.nodes)
    assert run.data.tags["derived.mesh"] == "2x2"  # replicate across nodes, shard within
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 4
    assert {"tokens_per_sec", "peak_memory_gb"} <= set(run.data.metrics)


def test_a_crashing_rank_fails_the_job_with_its_error(tmp_path, slurm_cluster):
    out = _cli(tmp_path, slurm_cluster, "cluster.nodes=2", "cluster.nproc_per_node=1",
               "cluster.wait=true", "train.max_steps=6", *FAST,
               "train.callbacks=[tests.faults.hooks:crash]",
               env_extra={"LLAMA_FSDP_TEST_CRASH": "rank=1,step=1"})
    log = out.stdout + out.stderr
    assert out.returncode == 1
    assert "the first rank to fail:\nrank 1 on node2" in log, log[-3000:]
    assert "injected fault on rank 1 after step 1" in log


def test_the_plan_sizes_a_nodes_memory_from_the_partition_when_mem_gb_is_unset(tmp_path,
                                                                              slurm_cluster):
    """cluster.mem_gb unset: the plan's capacity is the partition's nodes' memory as SLURM
    reports it, and says so (before: the submitting host's RAM, called "host RAM")."""
    out = _cli(tmp_path, slurm_cluster, "dry_run=true", "cluster.nproc_per_node=2", *FAST)
    assert out.returncode == 0, out.stderr[-3000:]
    mb = int(subprocess.run(["sinfo", "-h", "-p", slurm_cluster.partition, "-o", "%m"],
                            capture_output=True, text=True, check=True).stdout.split()[0])
    row = next(line for line in (out.stdout + out.stderr).splitlines()
               if line.strip().startswith("host capacity ("))
    assert f"(partition {slurm_cluster.partition}'s nodes, sinfo / ranks per node)" in row, row
    assert row.split()[-2] == f"{mb * 2**20 / 2 / 1e9:.2f}", row  # GB per rank


def test_invalid_partition_fails_at_submission_with_slurms_message(tmp_path, slurm_cluster):
    env = {**os.environ, **slurm_cluster.env}
    out = subprocess.run([warm.python(), "-m", "llama_fsdp", "cluster=slurm",
                          "cluster.partition=no_such_partition"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "invalid partition" in (out.stderr + out.stdout).lower()


def _wait_all_finished(cwd: Path, n: int, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, runs = _runs(cwd)
        done = [r for r in runs if r.info.status in ("FINISHED", "FAILED", "KILLED")
                and r.data.tags.get("llama_fsdp.kind") != "sweep"]
        if len(done) >= n:
            return done
        time.sleep(2)
    raise TimeoutError(f"{n} runs did not finish in {timeout}s")


def test_sweep_submits_every_point_at_once(tmp_path, slurm_cluster):
    """Every point submitted at once, summarized by the last job to end; its best point is the
    one with the lowest eval loss (before: the most tokens per second, whatever its loss), and
    the sweep says it submits its points (before: Hydra's "Launching 4 jobs locally")."""
    evaluated = [o for o in FAST if not o.startswith("eval.every_steps")]
    # two points are "every point at once" as well as four (the grid of two keys and its
    # table: tests/integration/test_docs_commands.py::test_sweep, run locally)
    out = _cli(tmp_path, slurm_cluster, "-m", "train.batch_size=2,4",
               "cluster.nproc_per_node=1", "train.max_steps=2", *evaluated, "eval.every_steps=2",
               "eval.max_batches=1")
    assert out.returncode == 0, out.stderr[-4000:]
    log = out.stdout + out.stderr
    assert log.count("submitted SLURM job") == 2
    assert "jobs locally" not in log
    assert "submitting 2 sweep points as SLURM jobs, all at once" in log
    # the summary at submission says the points are not done, and how to see it later
    assert re.search(r"\n[01] of 2 points ended; the summary is final when the last ends", log)
    assert "python -m llama_fsdp.sweep" in log
    runs = _wait_all_finished(tmp_path, 2, timeout=480)
    assert all(r.info.status == "FINISHED" for r in runs)
    assert len({r.data.tags["sweep_id"] for r in runs}) == 1
    sweep_id = runs[0].data.tags["sweep_id"]
    # submitted at once: every point's run began before the first point ended (a sweep that
    # waited for each job would start the next only after the previous one finished)
    starts = sorted(r.info.start_time for r in runs)
    ends = sorted(r.info.end_time for r in runs)
    assert starts[-1] < ends[0], (starts, ends)
    # one parent run holds the sweep; the last job to end completed its summary
    client, every = _runs(tmp_path)
    parents = [r for r in every if r.data.tags.get("llama_fsdp.kind") == "sweep"]
    assert len(parents) == 1
    parent = _wait_parent_finished(client, parents[0].info.run_id, timeout=60)
    assert parent.data.tags["status"] == "finished" and parent.data.tags["failed_points"] == "0"
    # (of equals, the first by name)
    best = min(runs, key=lambda r: (r.data.metrics["summary/eval_loss"], r.info.run_name))
    assert parent.data.tags["best point"] == best.info.run_name
    assert parent.data.tags["best by"] == "lowest summary/eval_loss"
    assert parent.data.metrics["best/eval_loss"] == best.data.metrics["summary/eval_loss"]
    assert {r.data.tags["mlflow.parentRunId"] for r in runs} == {parents[0].info.run_id}
    assert sorted(r.info.run_name for r in runs) == ["b=2", "b=4"]
    # on demand too, the same summary
    summary = subprocess.run([warm.python(), "-m", "llama_fsdp.tracking.sweep", sweep_id], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0 and "train.batch_size" in summary.stdout + summary.stderr
    assert "points ended" not in summary.stdout + summary.stderr
    assert (f"best point: {best.info.run_name} (lowest summary/eval_loss: "
            in summary.stdout + summary.stderr)
    parent = client.get_run(parents[0].info.run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["failed_points"] == "0"


def test_a_search_runs_its_n_jobs_trials_as_slurm_jobs_at_once(tmp_path, slurm_cluster):
    """A search on SLURM as typed (before: refused, "drop cluster.wait=false", which is
    cluster=slurm's default): trial 0, the run as configured, is one job waited for; then
    hydra.sweeper.n_jobs=2 trials are submitted together and waited for together (each one's
    run began before the other's ended), and each is told the value its run ended with."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    out = _cli(tmp_path, slurm_cluster, "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3",
               "hydra.sweeper.n_jobs=2", "hydra/sweeper/sampler=bruteforce",
               "hydra.sweeper.params.train.lr=choice(0.003, 0.001)", "cluster.nproc_per_node=1",
               "train.max_steps=2", "train.warmup_steps=1", "eval.every_steps=2",
               "eval.max_batches=1", "eval.task_prompts=0")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert log.count("submitted SLURM job") == 3, log[-4000:]
    assert re.search(r"trials 1, 2: SLURM jobs \d+, \d+ run at once; waiting for them", log), \
        log[-4000:]
    table = log[log.index("search sweep-"):]
    assert len(re.findall(r"^[012]\s+0\.00[13]\s+[\d.]+\s+finished$", table, re.M)) == 3, table
    _, runs = _runs(tmp_path)
    points = [r for r in runs if r.data.tags.get("llama_fsdp.kind") != "sweep"]
    assert sorted(r.info.status for r in points) == ["FINISHED"] * 3
    batch = [r for r in points if r.info.run_name != "as configured"]
    starts = sorted(r.info.start_time for r in batch)
    ends = sorted(r.info.end_time for r in batch)
    assert len(batch) == 2 and starts[-1] < ends[0], (starts, ends)
    (journal,) = tmp_path.rglob("optuna_study.jsonl")
    storage = JournalStorage(JournalFileBackend(str(journal)))
    study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
    told = sorted((t.params["train.lr"], t.value) for t in study.trials
                  if t.state.name == "COMPLETE")
    assert told == sorted((r.data.params["train.lr"], r.data.metrics["summary/eval_loss"])
                          for r in points), told


def _wait_parent_finished(client, run_id: str, timeout: float):
    """The sweep's parent once it ended (the last point's job summarizes after its run ends)."""
    deadline = time.monotonic() + timeout
    while (run := client.get_run(run_id)).info.status != "FINISHED":
        assert time.monotonic() < deadline, (run.info.status, run.data.tags)
        time.sleep(1)
    return run


# Seconds every rank sleeps after each step of the preempted job (tests.faults.hooks:slow): the
# signal goes out once MLflow shows 7 losses, so the job's last 23 steps take at least 11.5 s,
# however fast the node (unpaced, a fast node can finish them before the signal arrives, and the
# resume asserts fail); metrics reach MLflow within about a second, the signal another second.
# The requeued job is not paced (nothing waits on it).
PREEMPT_STEP_SLEEP_S = 0.5


def test_the_usr2_warning_checkpoints_requeues_the_job_and_it_finishes(tmp_path, slurm_cluster):
    """SIGUSR2, the warning submitit asks SLURM to send before the time limit
    (--signal=USR2@delay; sent here with scancel): the ranks save at their next log step, rank
    0 requeues the job, and the requeued job resumes from that checkpoint and finishes, each
    step once in MLflow. (A real preemption, SIGTERM and the partition's GraceTime:
    test_slurm_requeue.py.)"""
    from tests.faults import hooks

    # the only checkpoint a run of 30 steps saving every 100 steps can have is the one the
    # preemption signal makes
    steps, every = 30, 100
    out = _cli(tmp_path, slurm_cluster, "cluster.nproc_per_node=2", f"train.max_steps={steps}",
               f"save.every_steps={every}", "cluster.wait=false", *FAST,
               "train.callbacks=[tests.faults.hooks:slow]",
               env_extra={hooks.SLOW: str(PREEMPT_STEP_SLEEP_S), hooks.SLOW_FIRST: "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    job_id = (out.stdout + out.stderr).split("submitted SLURM job ")[1].split(":")[0].strip()
    client = _client(tmp_path)
    deadline = time.monotonic() + 300
    run = None
    while time.monotonic() < deadline:  # wait until training is under way (past a save)
        _, runs = _runs(tmp_path)
        if runs and len(client.get_metric_history(runs[0].info.run_id, "loss")) >= 7:
            run = runs[0]
            break
        time.sleep(1)
    assert run is not None, "the job never got going\n" + slurm_cluster.logs()
    # what SLURM sends before the time limit (submitit: --signal=USR2@delay)
    subprocess.run(["scancel", "--signal=USR2", job_id], env={**os.environ, **slurm_cluster.env},
                   check=True, timeout=30)
    runs = _wait_all_finished(tmp_path, 1, timeout=480)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        run = client.get_run(run.info.run_id)
        if run.info.status == "FINISHED":
            break
        time.sleep(2)
    assert run.info.status == "FINISHED", slurm_cluster.logs()
    history = client.get_metric_history(run.info.run_id, "loss")
    steps_logged = sorted(m.step for m in history)
    assert steps_logged == list(range(1, steps + 1)), steps_logged  # each step once, no gap
    resume_step = int(run.data.tags["resume_step"])
    assert 7 <= resume_step < steps  # the checkpoint the signal made, mid-run
    assert run.data.tags["restarts"] == "1"  # the requeued job (SLURM_RESTART_COUNT=1)
    restarts = client.get_metric_history(run.info.run_id, "restart")
    assert [(m.step, m.value) for m in restarts] == [(resume_step, 1.0)]
    ckpts = sorted(p.name for p in Path(run.data.tags["output_dir"], "checkpoints").iterdir())
    assert ckpts == [f"step_{resume_step:06d}", f"step_{steps:06d}"]


def test_a_run_directory_with_quotes_and_substitutions_runs_as_named(tmp_path, slurm_cluster):
    """A space, an apostrophe and `$(...)` in the run directory: the job runs, writes where it
    was told, and nothing in the name runs. Before: the unquoted `export
    TORCH_FR_DUMP_TEMP_FILE=...` line made the job script invalid (the apostrophe), and ran
    `$(...)` on the node."""
    marker = tmp_path / "marker"
    run = tmp_path / f"it's a run $(touch {marker})"
    out = _cli(tmp_path, slurm_cluster, f'output_dir="{run}"', "cluster.wait=true",
               "train.max_steps=2", "tracking.enabled=false", *FAST)
    assert out.returncode == 0, out.stderr[-4000:] + slurm_cluster.logs()
    assert json.loads((run / "run_status.json").read_text())["status"] == "finished"
    assert not marker.exists()
