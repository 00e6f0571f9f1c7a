"""The local SLURM test cluster works, and submitit multi-node gloo jobs run on it.

Job functions live at module level so that submitit pickles them by reference; the job imports
this module (the repository is on PYTHONPATH through the fixture's env), so keep the imports at
the top light.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from .conftest import REPO_ROOT, require_slurm, slurm_cluster_mod

pytestmark = pytest.mark.integration

SCRIPT = REPO_ROOT / "scripts" / "slurm_cluster.py"


# ------------------------------------------------------------------------------------------
# job functions (run on the nodes)
# ------------------------------------------------------------------------------------------

def allreduce_job() -> dict:
    from datetime import timedelta

    import submitit
    import torch
    import torch.distributed as dist

    env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        t = torch.tensor([float(env.rank + 1)])
        dist.all_reduce(t)
        dist.barrier()
        return {"rank": env.rank, "local_rank": env.local_rank, "world_size": env.world_size,
                "hostname": socket.gethostname(), "sum": float(t.item()),
                "master_addr": os.environ["MASTER_ADDR"]}
    finally:
        dist.destroy_process_group()


def one_rank_crashes_job() -> None:
    """Rank 3 raises; the others block in an all_reduce that will never complete."""
    from datetime import timedelta

    import submitit
    import torch
    import torch.distributed as dist

    env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    if env.rank == 3:
        raise RuntimeError("rank 3 fails on purpose")
    dist.all_reduce(torch.ones(1))


def raising_job(token: str) -> None:
    raise ValueError(f"deliberate failure {token}")


def hard_crash_job() -> None:
    os._exit(7)  # no result file: only accounting (sacct) can tell submitit what happened


# ------------------------------------------------------------------------------------------
# tests on the session cluster
# ------------------------------------------------------------------------------------------

def _wait_state(cluster, job, state: str, timeout: float = 60) -> dict:
    """Wait until sacct shows the job in `state`; submitit (which reads sacct) must agree."""
    deadline = time.monotonic() + timeout
    while True:
        rows = {r.get("JobID"): r for r in cluster.sacct(job.job_id)}
        if rows.get(job.job_id, {}).get("State") == state:
            assert job.get_info(mode="force").get("State") == state
            return rows
        assert time.monotonic() < deadline, f"job {job.job_id} never {state}: {rows}"
        time.sleep(0.5)


def test_cluster_is_up(slurm_cluster):
    # the session's cluster: jobs of earlier tests may still be completing for a few seconds
    deadline = time.monotonic() + 60
    while True:
        out = subprocess.run(["sinfo", "-h", "-N", "-p", slurm_cluster.partition, "-o",
                              "%N %T %c %P"], capture_output=True, text=True, timeout=30,
                             check=True).stdout.split("\n")
        rows = sorted(line.split() for line in out if line.strip())
        if all(r[1] == "idle" for r in rows) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert [r[0] for r in rows] == slurm_cluster.nodes, out
    assert all(r[1] == "idle" for r in rows), out
    assert all(int(r[2]) == slurm_cluster.cpus_per_node for r in rows), out
    assert all(r[3].rstrip("*") == slurm_cluster.partition for r in rows), out
    assert os.environ["SLURM_CONF"] == slurm_cluster.env["SLURM_CONF"]


def test_two_nodes_two_tasks_gloo_allreduce(slurm_cluster, tmp_path):
    ex = slurm_cluster.executor(slurm_cluster.submitit_folder(tmp_path), nodes=2,
                                tasks_per_node=2, cpus_per_task=1, timeout_min=5)
    t0 = time.monotonic()
    job = ex.submit(allreduce_job)
    slurm_cluster.wait(job, timeout=180)
    results = job.results()
    elapsed = time.monotonic() - t0
    print(f"2x2 gloo job round trip: {elapsed:.1f}s")

    by_rank = {r["rank"]: r for r in results}
    assert sorted(by_rank) == [0, 1, 2, 3], results
    assert all(r["sum"] == 10.0 for r in results), results       # 1 + 2 + 3 + 4
    assert all(r["world_size"] == 4 for r in results), results
    hosts = [by_rank[i]["hostname"] for i in range(4)]
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3] and hosts[0] != hosts[2], hosts
    assert set(hosts) == set(slurm_cluster.nodes), hosts
    assert [by_rank[i]["local_rank"] for i in range(4)] == [0, 1, 0, 1], results
    assert {r["master_addr"] for r in results} == {hosts[0]}, results

    # results are written before the tasks exit: the job may still be finishing
    rows = _wait_state(slurm_cluster, job, "COMPLETED")
    assert rows[job.job_id]["NodeList"] == "node[1-2]", rows


def test_raising_job_is_failed_with_its_message(slurm_cluster, tmp_path):
    token = f"tok{os.getpid()}x{time.time_ns() % 10**6}"
    job = slurm_cluster.executor(slurm_cluster.submitit_folder(tmp_path)).submit(raising_job, token)
    slurm_cluster.wait(job, timeout=120)
    exc = job.exception()
    assert exc is not None
    assert f"ValueError: deliberate failure {token}" in str(exc), str(exc)
    _wait_state(slurm_cluster, job, "FAILED")


def test_hard_crash_is_failed_not_unknown(slurm_cluster, tmp_path):
    """A job that dies without writing a result (killed, segfault, os._exit) must still end:
    submitit falls back to sacct, so accounting has to report FAILED."""
    ex = slurm_cluster.executor(slurm_cluster.submitit_folder(tmp_path), nodes=2, tasks_per_node=2)
    job = ex.submit(hard_crash_job)
    t0 = time.monotonic()
    slurm_cluster.wait(job, timeout=120)
    assert job.state == "FAILED", (job.state, slurm_cluster.sacct(job.job_id))
    exc = job.exception()
    assert exc is not None and "FAILED" in str(exc), str(exc)
    with pytest.raises(Exception, match="has not produced any output"):
        job.result()
    print(f"hard crash reported in {time.monotonic() - t0:.1f}s")


def test_one_crashing_rank_ends_the_job_with_kill_on_bad_exit(slurm_cluster, tmp_path):
    """Without --kill-on-bad-exit the other ranks would wait out their 300 s gloo timeout."""
    ex = slurm_cluster.executor(slurm_cluster.submitit_folder(tmp_path), nodes=2, tasks_per_node=2,
                                slurm_srun_args=["--kill-on-bad-exit=1"])
    job = ex.submit(one_rank_crashes_job)
    slurm_cluster.wait(job, timeout=120)  # raises if the job is still there: the ranks waited
    _wait_state(slurm_cluster, job, "FAILED")
    exc = job._sub_jobs[3].exception()
    assert exc is not None and "rank 3 fails on purpose" in str(exc), str(exc)


def test_invalid_partition_fails_at_submission(slurm_cluster, tmp_path):
    ex = slurm_cluster.executor(slurm_cluster.submitit_folder(tmp_path),
                                slurm_partition="no_such_partition")
    with pytest.raises(Exception) as info:
        ex.submit(raising_job, "never-runs")
    assert "invalid partition specified" in str(info.value).lower(), str(info.value)


def hostname_job() -> str:
    return socket.gethostname()


def test_factory_cluster_with_extra_conf(slurm_cluster, slurm_cluster_factory, tmp_path):
    """A second cluster beside the session's, with its own slurm.conf lines; `activate()`
    points submitit at it, and the session cluster is untouched afterwards."""
    extra = slurm_cluster_factory(nodes=1, extra_conf=["PartitionName=other Nodes=node1 Default=NO"])
    assert extra.info.subnet != slurm_cluster.info.subnet
    with extra.activate():
        ex = extra.executor(extra.submitit_folder(tmp_path), slurm_partition="other")
        job = ex.submit(hostname_job)
        extra.wait(job, timeout=120)
        assert job.result() == "node1"
        # accounting is eventually consistent: the partition can show up after the end state
        deadline = time.monotonic() + 60
        while "other" not in {r.get("Partition") for r in extra.sacct(job.job_id)}:
            assert time.monotonic() < deadline, extra.sacct(job.job_id)
            time.sleep(0.5)
    assert os.environ["SLURM_CONF"] == slurm_cluster.env["SLURM_CONF"]
    assert [r["JobID"] for r in slurm_cluster.sacct(job.job_id)] == []   # not the session's job


# ------------------------------------------------------------------------------------------
# lifecycle of a separate cluster, through the command line
# ------------------------------------------------------------------------------------------

def _cli(*args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout)


def test_cli_up_status_down_cleanly(tmp_path_factory):
    """A second, 1-node cluster beside the session's: `up` twice (idempotent), `status`, then
    `down` of a half-broken cluster leaves no daemon, namespace or bridge behind."""
    require_slurm()
    state = tmp_path_factory.mktemp("slurm_cli")
    try:
        p = _cli("up", "--nodes", "1", "--state-dir", str(state))
        assert p.returncode == 0, p.stderr
        assert f"export SLURM_CONF={state}/slurm.conf" in p.stdout, p.stdout
        assert (state / "env.sh").read_text().strip() == f"export SLURM_CONF={state}/slurm.conf"
        first = slurm_cluster_mod.Cluster.load(state)

        p = _cli("up", "--nodes", "1", "--state-dir", str(state))      # again: replaces it
        assert p.returncode == 0, p.stderr
        second = slurm_cluster_mod.Cluster.load(state)
        assert second.token != first.token
        if first.index != second.index:  # the same index: the new cluster owns those names
            assert slurm_cluster_mod.leftovers(first) == []
        for key, pid in first.pids.items():
            assert not slurm_cluster_mod._alive(pid, key.split(":")[0]), (key, pid)

        p = _cli("status", "--state-dir", str(state), timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
        assert '"up": true' in p.stdout and "node1 idle" in p.stdout, p.stdout

        # half-broken: controller killed, the node's namespace deleted under slurmd's feet
        os.kill(second.pids["slurmctld"], 9)
        subprocess.run(["ip", "netns", "del", second.netns(0)], timeout=10, check=True)

        p = _cli("down", "--state-dir", str(state), timeout=60)
        assert p.returncode == 0, p.stderr
        assert slurm_cluster_mod.leftovers(second) == []
        for key, pid in second.pids.items():
            assert not slurm_cluster_mod._alive(pid, key.split(":")[0]), (key, pid)
        p = _cli("status", "--state-dir", str(state), timeout=60)
        assert p.returncode != 0 and '"up": false' in p.stdout
        assert _cli("down", "--state-dir", str(state), timeout=60).returncode == 0  # again: no-op
    finally:
        slurm_cluster_mod.down(state)
