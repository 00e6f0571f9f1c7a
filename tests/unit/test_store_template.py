"""A new sqlite store is a copy of an empty store that MLflow made once (tracking/store.py):
it must be the store MLflow would have made here, schema, migration head and default
experiment alike, and work as one. (Why: MLflow's ~90 migrations cost 2-3 s of CPU per new
store, in every first run of a directory and every test that tracks.)"""
from __future__ import annotations

import re
import sqlite3

from mlflow.tracking import MlflowClient

from llama_fsdp.tracking import store


def _normal(sql: str) -> str:
    """A CREATE statement with its lines (columns, constraints) sorted and the values of each
    ``IN (...)`` sorted: MLflow writes some tables' constraints from Python sets, in an order
    that differs between two stores it makes itself (hash seed)."""
    sql = re.sub(r"IN \(([^)]*)\)", lambda m: "IN (" + ", ".join(
        sorted(v.strip() for v in m.group(1).split(","))) + ")", sql)
    return "\n".join(sorted(line.strip().rstrip(",") for line in sql.splitlines()))


def _dump(db):
    with sqlite3.connect(db) as conn:
        schema = sorted(_normal(r[0]) for r in conn.execute(
            "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL"))
        head = conn.execute("SELECT version_num FROM alembic_version").fetchall()
        exps = conn.execute("SELECT experiment_id, name, artifact_location, lifecycle_stage "
                            "FROM experiments").fetchall()
    conn.close()
    return schema, head, exps


def test_a_store_from_the_template_is_the_store_mlflow_makes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    by_mlflow = tmp_path / "a" / "mlflow.db"
    by_mlflow.parent.mkdir()
    MlflowClient(tracking_uri=f"sqlite:///{by_mlflow}").search_experiments(max_results=1)
    copied = tmp_path / "b" / "mlflow.db"
    client = store.open_client(f"sqlite:///{copied}")
    template = next((tmp_path / "cache" / "llama_fsdp").glob("mlflow-*-empty.db"))
    assert _dump(copied) == _dump(by_mlflow)
    # the default experiment points where MLflow points it from here, not at the template's
    assert _dump(copied)[2][0][2] == str(tmp_path / "mlruns" / "0")
    exp = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    run = client.create_run(exp)
    client.log_metric(run.info.run_id, "loss", 1.5, step=1)
    client.set_terminated(run.info.run_id)
    assert client.get_metric_history(run.info.run_id, "loss")[0].value == 1.5
    # the next new store copies the same template; an existing store is left as it is
    built = template.stat().st_mtime_ns
    store.open_client(f"sqlite:///{tmp_path / 'c' / 'mlflow.db'}")
    assert template.stat().st_mtime_ns == built
    assert _dump(tmp_path / "c" / "mlflow.db") == _dump(by_mlflow)
    store.open_client(f"sqlite:///{copied}")
    assert MlflowClient(f"sqlite:///{copied}").get_run(run.info.run_id).info.status == "FINISHED"


def test_without_a_writable_cache_mlflow_makes_the_store(tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "mlflow.db"
    store.open_client(f"sqlite:///{db}").create_experiment("e")
    assert not (tmp_path / "mlflow.db.part").exists()
    assert [e.name for e in MlflowClient(f"sqlite:///{db}").search_experiments()] == ["e",
                                                                                      "Default"]
