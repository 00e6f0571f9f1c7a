"""No secret reaches disk, stdout or MLflow: a real run against a real `mlflow server` with
MLflow's basic auth, its password in the tracking URI, an `${oc.env:...}` config value and
HF_TOKEN in the environment; then the run directory, everything printed, and the server's
store (its backend database and artifact root) are searched for each secret."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CI_ENV
from tests import warm
from tests.faults.conftest import FAST, MlflowServer

pytestmark = [pytest.mark.slow]

PASSWORD = "S3cr3t-pa55-xyzzy-1729"
ACCOUNT = "acct-v4lue-0f-an-env-var"
HF_TOKEN = "hf_t0k3n_n3v3r_wr1tt3n"
SECRETS = (PASSWORD, ACCOUNT, HF_TOKEN)
# MLflow's basic-auth app needs Flask-WTF (mlflow[auth], a dev dependency); without it the
# server takes any request, and the search below still finds every secret that was written,
# but "the credentials reached the server" holds whether they did or not: under CI that fails
# the module's tests; elsewhere each test runs its search, then skips, saying what it left out
AUTH = importlib.util.find_spec("flask_wtf") is not None
NO_AUTH = ("flask_wtf is not installed (mlflow[auth], a dev dependency): the MLflow server "
           "ran without auth, so whether the credentials reached it was not tested")


def _hits(root: Path, text: str, secrets: tuple[str, ...] = SECRETS) -> list[str]:
    found = [str(p) for p in root.rglob("*") if p.is_file() and p.name != "auth.ini"
             and any(s.encode() in p.read_bytes() for s in secrets)]
    return found + [s for s in secrets if s in text]


def _cli(cwd: Path, *args: str, env: dict, python: str = sys.executable
         ) -> subprocess.CompletedProcess:
    return subprocess.run([python, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})


def _runs(server: MlflowServer) -> list:
    """The server's runs, asked with the admin's credentials (as the tests' own client)."""
    from mlflow.tracking import MlflowClient

    from llama_fsdp.launchers.environment import scoped_environ

    with scoped_environ({"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": PASSWORD}):
        client = MlflowClient(server.uri)
        return client.search_runs([client.get_experiment_by_name("llama_fsdp").experiment_id])


def _credentials_were_tested() -> None:
    """At the end of a test: without auth, a skip that says what was not tested."""
    if not AUTH:
        pytest.skip(NO_AUTH)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not AUTH and os.environ.get(CI_ENV) == "1":
        pytest.fail(f"{CI_ENV}=1 and {NO_AUTH}")
    root = tmp_path_factory.mktemp("mlflow-auth")
    s = MlflowServer(root, admin=("admin", PASSWORD) if AUTH else None).start(timeout=180)
    yield s
    s.kill()


def test_a_run_with_a_password_in_its_uri_writes_no_secret_anywhere(tmp_path, server):
    """Before: the password was in stdout, config.yaml, tracking/run.json, the spool,
    owner.json, the submitit pickle, and in MLflow (the tracking.uri param, the command-line
    note and the config.yaml artifact); ${oc.env:...} values were written resolved."""
    uri = server.uri.replace("http://", f"http://admin:{PASSWORD}@")
    env = {"HF_TOKEN": HF_TOKEN, "SECRET_ACCOUNT": ACCOUNT}
    out = _cli(tmp_path, "-m", "llama_fsdp", *FAST, "train.max_steps=2", f"tracking.uri={uri}",
               "cluster.account=${oc.env:SECRET_ACCOUNT}", "output_dir=run", env=env)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    # the credentials reached the server (with auth on, no request gets in without them)
    run = _runs(server)[0]
    assert run.info.status == "FINISHED" and run.data.metrics["loss"] > 0
    assert run.data.params["tracking.uri"] == server.uri
    assert run.data.params["cluster.account"] == "${oc.env:SECRET_ACCOUNT}"
    assert f"tracking.uri={server.uri}" in run.data.tags["mlflow.note.content"]
    # a refusal (the store does not answer) and a later delivery show no secret either
    dead = uri.replace(str(server.port), "1")
    refused = _cli(tmp_path, "-m", "llama_fsdp", *FAST, f"tracking.uri={dead}", env=env)
    assert refused.returncode == 2 and "does not answer" in refused.stderr + refused.stdout
    replay = _cli(tmp_path, "-m", "llama_fsdp.tracking", "run", "--uri", uri, env=env)
    assert replay.returncode == 0, replay.stderr[-2000:]
    shown = log + refused.stdout + refused.stderr + replay.stdout + replay.stderr
    assert _hits(tmp_path, shown, (PASSWORD, HF_TOKEN)) == []  # run dir, caches: nothing
    assert _hits(server.root, "") == []  # the server's database and artifact root
    # the value of the ${oc.env:...} key is only where the ranks read the run from: the
    # pickled job, in folders of the user's alone
    run = tmp_path / "run"
    assert {Path(p).parent for p in _hits(tmp_path, shown)} <= {run / "submitit"}
    assert all((run / d).stat().st_mode & 0o777 == 0o700 for d in ("submitit", "launch"))
    _credentials_were_tested()


def test_a_sweep_with_a_password_in_its_uri_writes_none(tmp_path, server):
    """Before: Hydra's multirun.yaml (the sweep's composed config and overrides) and the
    sweep's parent run held the password. A real sweep (one 2-step point) (a dry-run sweep
    records nothing and leaves no folder: tests/unit/test_bad_input.py), forked warm: what is
    checked is what it writes, not how it starts."""
    uri = server.uri.replace("http://", f"http://admin:{PASSWORD}@")
    out = _cli(tmp_path, "-m", "llama_fsdp", "-m", *FAST, "train.max_steps=2",
               "train.batch_size=2", f"tracking.uri={uri}", env={}, python=warm.python())
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert list(tmp_path.glob("outputs/sweeps/*/*/multirun.yaml"))  # Hydra wrote it
    runs = _runs(server)  # (the module's server also holds the other test's run)
    (parent,) = [r for r in runs if r.data.tags.get("llama_fsdp.kind") == "sweep"]
    points = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert [r.info.status for r in points] == ["FINISHED"], [(r.info.run_name, r.info.status)
                                                           for r in runs]
    assert _hits(tmp_path, out.stdout + out.stderr) == []
    assert _hits(server.root, "") == []
    _credentials_were_tested()
