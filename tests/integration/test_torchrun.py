"""cluster=torchrun: the same worker in processes that torchrun, or a Kubernetes-style launch
by environment variables, starts. Real torchrun agents, real gloo ranks, real MLflow.

The torchrun agents and the processes they start are real interpreters (they are what this
checks); the commands the tests start themselves (the cluster=local references, the processes
of a launch by environment variables, the refusals) are forked warm (tests/warm.py): each is
its own process with its own environment, without importing torch again."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from llama_fsdp.launchers.environment import free_port
from llama_fsdp.tracking import Spool, events, read_run_file
from tests import warm
from tests.faults import hooks

pytestmark = [pytest.mark.slow]

SHORT = ["cluster.device=cpu", "train.max_steps=4", "train.warmup_steps=0",
         "eval.every_steps=0", "eval.task_prompts=0", "data.num_records=400"]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _logged(run: Path) -> list[tuple[int, float]]:
    """(step, global loss) in the order rank 0 recorded them (its spool): a restarted run logs
    again from the step after its checkpoint."""
    return [(e.step, e.metrics["loss"]) for e in Spool(run).events()
            if isinstance(e, events.Metrics) and "loss" in e.metrics]


def _losses(run: Path) -> dict[int, float]:
    """Step -> global loss, as rank 0 recorded them."""
    return dict(_logged(run))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE")}
    return {**env, **extra}


def _torchrun(cwd: Path, *args: str, nnodes: int = 1, nproc: int = 2, port: int,
              run_id: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [TORCHRUN, f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}", "-m", "llama_fsdp",
         "cluster=torchrun", *args],
        cwd=cwd, env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _local(cwd: Path, *args: str) -> dict[int, float]:
    """The same run under cluster=local: its losses."""
    out = subprocess.run([warm.python(), "-m", "llama_fsdp", *SHORT, *args],
                         cwd=cwd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return _losses(next((cwd / "outputs" / "runs").glob("*/*")))


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory):
    """4 ranks, hybrid 2 x 2 (two "nodes" of 2), under cluster=local."""
    return _local(tmp_path_factory.mktemp("local"), "cluster.nproc_per_node=4",
                  "sharding=hybrid", "sharding.shard_size=2")


def test_two_torchrun_nodes_train_the_local_run_s_curve(tmp_path, local_reference):
    """Two torchrun agents on this machine (--nnodes=2, c10d rendezvous on 127.0.0.1) as two
    nodes of 2 ranks, sharding=hybrid across them: the loss curve is the 4-rank local one."""
    port = free_port()
    agents = [_torchrun(tmp_path, *SHORT, "sharding=hybrid", nnodes=2, port=port,
                        run_id="two-nodes") for _ in range(2)]
    outs = [a.communicate(timeout=900)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n=====\n".join(o[-3000:] for o in outs)
    log = "".join(outs)
    assert log.count("status         finished") == 1  # rank 0 speaks for the job
    assert "world_size                     4 = 2 node(s) x 2" in log
    run = tmp_path / "outputs" / "runs" / "torchrun-two-nodes"
    assert _losses(run) == pytest.approx(local_reference, abs=1e-6)
    assert sorted(_losses(run)) == [1, 2, 3, 4]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/outputs/mlflow.db")
    r = client.get_run(read_run_file(run)["run_id"])
    assert r.info.status == "FINISHED" and r.data.tags["derived.mesh"] == "2x2"
    # Hydra's own per-process run directories were made and are gone
    assert [p.name for p in (tmp_path / "outputs" / "runs").iterdir()] == ["torchrun-two-nodes"]


def test_torchrun_restarts_a_killed_rank_from_its_checkpoint(tmp_path):
    """SIGKILL on rank 1 after step 3 under --max-restarts=1: torchrun starts every process
    again, and the run resumes from step 2's checkpoint in the same MLflow run, every loss
    the one the same run under cluster=local logs uninterrupted."""
    env = _env(**{hooks.SIGNAL: "rank=1,step=3,sig=KILL", hooks.MARK: str(tmp_path / "fired")})
    agent = subprocess.Popen(
        [TORCHRUN, "--nnodes=1", "--nproc_per_node=2", "--max-restarts=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=restart",
         "-m", "llama_fsdp", "cluster=torchrun", *SHORT,
         "save.every_steps=2", "train.callbacks=[tests.faults.hooks:self_signal]"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = agent.communicate(timeout=900)[0]
    assert agent.returncode == 0, out[-4000:]
    assert "resumed from" in out and "status         finished" in out
    run = tmp_path / "outputs" / "runs" / "torchrun-restart"
    r = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/outputs/mlflow.db").get_run(
        read_run_file(run)["run_id"])
    assert r.info.status == "FINISHED"
    assert r.data.tags["restarts"] == "1" and r.data.tags["resume_step"] == "2"
    # 1-3 from the first attempt (3 never checkpointed), then 3-4 again from step 2's state
    logged = _logged(run)
    assert [s for s, _ in logged] == [1, 2, 3, 3, 4]
    (tmp_path / "local").mkdir()
    uninterrupted = _local(tmp_path / "local")  # 2 local ranks, like the agent's
    assert [loss for _, loss in logged] == [uninterrupted[s] for s, _ in logged]


def test_a_launch_by_environment_variables_runs_the_same_worker(tmp_path):
    """As Kubernetes operators start a job: every process gets RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT, one process per "node"; output_dir names the run directory they share."""
    port, run = free_port(), tmp_path / "run"
    procs = [subprocess.Popen(
        [warm.python(), "-m", "llama_fsdp", "cluster=torchrun", *SHORT, f"output_dir={run}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
        for r in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n=====\n".join(o[-3000:] for o in outs)
    assert "world_size                     2 = 2 node(s) x 1" in outs[0]
    assert "status         finished" in outs[0] and "status" not in outs[1]
    assert sorted(_losses(run)) == [1, 2, 3, 4]


def test_what_torchrun_cannot_run_is_refused_plainly(tmp_path):
    """A config that disagrees with the launch, a sweep, and a launch without a run directory
    every process agrees on: each refused before training, with the fix."""
    port = free_port()
    bad = _torchrun(tmp_path, *SHORT, "cluster.nproc_per_node=3", port=port, run_id="bad")
    out = bad.communicate(timeout=600)[0]
    assert bad.returncode != 0
    assert ("cluster.nproc_per_node=3 but the launcher started 2 (from WORLD_SIZE=2, "
            "LOCAL_WORLD_SIZE=2)") in out
    env = _env(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    sweep = subprocess.run([warm.python(), "-m", "llama_fsdp", "-m", "cluster=torchrun", *SHORT,
                            "train.batch_size=1,2", f"output_dir={tmp_path}/s"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=600)
    assert sweep.returncode == 2
    assert "sweeps (-m) do not run under cluster=torchrun" in sweep.stdout + sweep.stderr
    nodir = subprocess.run([warm.python(), "-m", "llama_fsdp", "cluster=torchrun", *SHORT],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert nodir.returncode == 2
    assert "needs a run directory every process and restart agrees on" in nodir.stdout + \
        nodir.stderr
    assert not (tmp_path / "outputs" / "runs").exists() or not any(
        (tmp_path / "outputs" / "runs").rglob("*.yaml"))
