"""The SLURM block of docs/slurm.md, run as a user runs it: install the dependencies, bring a
2-node cluster up with scripts/slurm_cluster.sh, run the documented job on it and wait for it,
take the cluster down. Each command comes from the docs through the registry
(tests/docs_commands.py), with only the changes it states. The cluster is the block's own (its
`up`), not the session fixture's; the SLURM commands that name GPUs are planned as dry runs in
test_docs_commands.py."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests import docs_commands as docs
from tests.integration.conftest import require_slurm, slurm_cluster_mod

pytestmark = [pytest.mark.slow]

REPO = docs.REPO


def test_slurm_deps():
    require_slurm()  # with everything installed (CI installed it with this very script)
    cmd, env = docs.command("slurm_deps")
    r = docs.run(cmd, REPO, env, timeout=600)
    assert r.returncode == 0, str(r)
    assert r.seconds < 30 and not r.output.strip(), str(r)  # nothing to install: quiet, at once
    assert slurm_cluster_mod.missing_requirements() == []


@pytest.fixture
def state_dir():
    """A private state folder for the block's cluster (short: unix sockets live under it); the
    cluster in it is taken down whatever happens."""
    d = Path(tempfile.mkdtemp(prefix="lfdocs-", dir="/tmp"))
    yield d
    if slurm_cluster_mod.Cluster.load(d) is not None:
        slurm_cluster_mod.down(d)
    shutil.rmtree(d, ignore_errors=True)


def test_slurm_block(tmp_path, state_dir):
    require_slurm()
    fill = {"repo": str(REPO), "state_dir": str(state_dir)}
    up, up_env = docs.command("slurm_up", **fill)
    job, job_env = docs.command("slurm_run", **fill)
    down, down_env = docs.command("slurm_down", **fill)
    assert not (up_env or job_env or down_env)
    # the block in one shell, as typed: `eval` exports SLURM_CONF for the commands after it;
    # the echo lines only mark where each command's output ends
    script = "\n".join([
        up,
        f'[ "$SLURM_CONF" = "{state_dir}/slurm.conf" ] || {{ echo "no SLURM_CONF"; exit 90; }}',
        f"cp {state_dir}/cluster.json {tmp_path}/cluster.json",  # what it made (down deletes it)
        "sinfo -h -N -o '%N %T'",
        job,
        'echo "job command exit $?"',
        down,
        'echo "down exit $?"',
    ])
    r = docs.run(script, tmp_path, timeout=900)
    out = r.output
    assert r.returncode == 0, str(r)
    # up: both nodes idle in the debug partition
    assert "node1 idle" in out and "node2 idle" in out, str(r)
    # the job: 2 nodes x 2 CPU ranks, hybrid (replicate across nodes, shard within), waited for
    assert "job command exit 0" in out, str(r)
    assert "submitted SLURM job" in out and "train: 100%" in out  # rank 0's log, streamed
    assert docs.summary_value(out, "status") == "finished"
    assert docs.summary_value(out, "steps") == "2"
    run_id = docs.summary_value(out, "mlflow run").split()[0]
    run = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/outputs/mlflow.db").get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["derived.mesh"] == "2x2"
    assert run.data.tags["rank_hosts"].split(",") == ["node1", "node1", "node2", "node2"]
    # down: nothing of the cluster is left
    assert "down exit 0" in out
    made = slurm_cluster_mod.Cluster.from_json(json.loads((tmp_path / "cluster.json").read_text()))
    assert slurm_cluster_mod.leftovers(made) == []
