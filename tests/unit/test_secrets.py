"""Secrets never reach what a run writes or shows: a tracking URI's credentials travel in the
environment, ``${oc.env:...}`` values are written as their interpolation. (The end-to-end
check, a real run against a real `mlflow server` with basic auth, is
tests/integration/test_secrets.py.)"""
from __future__ import annotations

import pickle

import pytest

from llama_fsdp.config import credentials as secrets
from llama_fsdp.run.spec import ConfigError
from tests.conftest import make_spec

PW = "pa55:w/rd@secret"  # characters a URI must escape
URI = "http://alice:pa55%3Aw%2Frd%40secret@mlflow.example:5000/base"


def test_a_uris_credentials_go_to_the_environment_as_mlflow_reads_them():
    clean, env = secrets.split_credentials(URI + "?token=t0k3n&x=1")
    assert clean == "http://mlflow.example:5000/base?x=1"
    assert env == {secrets.USERNAME: "alice", secrets.PASSWORD: PW, secrets.TOKEN: "t0k3n"}
    assert secrets.split_credentials("sqlite:///outputs/mlflow.db") == (
        "sqlite:///outputs/mlflow.db", {})
    with pytest.raises(secrets.SecretInURI, match=r"carries \?api_key="):
        secrets.split_credentials("https://h/?api_key=zzz")
    environ: dict[str, str] = {}
    assert secrets.export_credentials(URI, environ) == "http://mlflow.example:5000/base"
    assert environ[secrets.PASSWORD] == PW
    # a database store takes them in its URI: put back in memory, from the environment
    assert secrets.client_uri("postgresql://db.example/mlflow", environ) == \
        "postgresql://alice:pa55%3Aw%2Frd%40secret@db.example/mlflow"
    assert secrets.client_uri("http://h:5000", environ) == "http://h:5000"


def test_urls_are_redacted_wherever_they_are_shown():
    text = f"tracking.uri={URI}?token=abc&access_token=def and https://u@h/x?sig=1&k=2"
    shown = secrets.redact(text)
    assert "alice" not in shown and "abc" not in shown and "def" not in shown
    assert shown == ("tracking.uri=http://***@mlflow.example:5000/base?token=***&access_token=***"
                     " and https://***@h/x?sig=***&k=2")


def test_the_spec_and_what_it_writes_hold_no_credential_and_no_env_value(monkeypatch, tmp_path):
    """Before: config.yaml, the MLflow params and the pickled spec held the password, and the
    value of every ${oc.env:...} key."""
    monkeypatch.setenv("SECRET_ACCOUNT", "acct-s3cr3t")
    monkeypatch.setenv("HF_TOKEN", "hf_s3cr3t")
    spec = make_spec([f"tracking.uri={URI}", "cluster.account=${oc.env:SECRET_ACCOUNT}",
                      "cluster.qos=q-${cluster.account}"], output_dir=tmp_path)
    assert spec.tracking_uri == spec.tracking.uri == "http://mlflow.example:5000/base"
    assert spec.cluster.account == "acct-s3cr3t"  # the run itself has the value
    written = spec.config_yaml + repr(pickle.dumps(spec))
    for secret in ("alice", "pa55", "hf_s3cr3t"):
        assert secret not in written
    assert "account: ${oc.env:SECRET_ACCOUNT}" in spec.config_yaml
    assert "qos: q-${cluster.account}" in spec.config_yaml  # an interpolation of it, too
    assert "acct-s3cr3t" not in spec.config_yaml
    with pytest.raises(ConfigError, match=r"carries \?api_key=, which MLflow cannot"):
        make_spec(["tracking.uri='https://h/?api_key=zzz'"], output_dir=tmp_path)


def test_the_command_line_as_stored_has_no_credential(monkeypatch):
    from llama_fsdp.cli import command as cli

    monkeypatch.setattr("sys.argv", ["x", f"tracking.uri={URI}", "data.path=https://u:p@h/d",
                                     "train.lr=0.1"])
    line = cli.command_line()
    assert line == ("python -m llama_fsdp tracking.uri=http://mlflow.example:5000/base "
                    "'data.path=https://***@h/d' train.lr=0.1")


def test_a_secret_in_a_setup_line_is_masked_wherever_the_config_is_stored(tmp_path):
    """Before: `export HF_TOKEN=...` in cluster.setup reached config.yaml and MLflow's params.
    The job script still exports the real value: the job needs it."""
    from omegaconf import OmegaConf

    from llama_fsdp.launchers.slurm import sbatch_preview
    from llama_fsdp.tracking import flatten

    secret = "hf_s3cretVALUE42"
    spec = make_spec(["cluster=slurm", "cluster.timeout_min=60",
                      f"cluster.setup=['export HF_TOKEN={secret}','export PATH=/opt/bin:$PATH']"],
                     output_dir=tmp_path / "run")
    assert secret not in spec.config_yaml
    params = flatten(OmegaConf.to_container(OmegaConf.create(spec.config_yaml)))
    assert params["cluster.setup"] == ["export HF_TOKEN=***", "export PATH=/opt/bin:$PATH"]
    assert f"export HF_TOKEN={secret}" in sbatch_preview(spec)
