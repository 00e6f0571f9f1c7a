"""The MLflow store: opening a client safely, where artifacts go, and the experiment's view."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from ..result import SUMMARY
from ..config import ObjectiveConfig

# MLflow's own HTTP retries would hold a call for minutes; the shipper retries instead.
FAST_FAIL_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
EXPERIMENT_KIND = "finetuning"  # mlflow.experimentKind: a model-training experiment
VIEW = "llama_fsdp"  # a saved runs-table view: open the runs page with ?viewStateShareKey=llama_fsdp
VIEW_TAG = f"mlflow.sharedViewState.{VIEW}"
VIEW_COLUMNS = ["attributes.`Dataset`", "attributes.`Models`",
                *(f"metrics.`{m}`" for m in (SUMMARY.tokens_per_sec,
                                             SUMMARY.tokens_per_sec_per_device, SUMMARY.mfu,
                                             SUMMARY.peak_memory_gb,
                                             SUMMARY.predicted_peak_memory_gb,
                                             SUMMARY.final_loss, SUMMARY.eval_loss)),
                *(f"params.`{p}`" for p in ("model.name", "finetune.method", "optim.name",
                                            "sharding.strategy", "precision.name",
                                            "train.batch_size")),
                "metrics.`trainable_params`", "metrics.`total_params`",  # what the method trains
                # objective=dpo: what it trains for, and how well the held-out pairs agree
                "params.`objective.name`", "params.`objective.beta`",
                *(f"metrics.`{m}`" for m in ObjectiveConfig.SUMMARY),
                "tags.`derived.world_size`"]


def open_client(uri: str) -> Any:
    """An MlflowClient. Opening a sqlite store creates or migrates its schema, and two
    processes doing that at once leave it broken (a half-applied migration), as parallel sweep
    jobs on a fresh store would: the first open is serialized by a lock file beside it."""
    from mlflow.tracking import MlflowClient

    if not uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=uri)
    from filelock import FileLock

    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(db) + ".lock"):
        if not db.exists():
            _new_sqlite_store(db)
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)  # the store is created and migrated here
    return client


def _template_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama_fsdp"


def _new_sqlite_store(db: Path) -> None:
    """A new sqlite store as a copy of an empty one this MLflow version made, with its default
    experiment's artifact location set as MLflow would have set it here. MLflow builds a fresh
    store by running its ~90 schema migrations, every time (benchmarks/cpu_runtime.md); the empty
    store is built that way once per MLflow version and machine (in ~/.cache/llama_fsdp) and
    copied after. Anything unexpected (no writable cache, another layout) leaves the store to MLflow."""
    import shutil
    import sqlite3

    import mlflow
    from filelock import FileLock

    try:
        cache = _template_dir()
        cache.mkdir(parents=True, exist_ok=True)
        template = cache / f"mlflow-{mlflow.__version__}-empty.db"
        with FileLock(str(template) + ".lock"):
            if not template.exists():
                tmp = template.with_suffix(".tmp")
                tmp.unlink(missing_ok=True)
                from mlflow.tracking import MlflowClient

                MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments(max_results=1)
                tmp.replace(template)
        part = db.with_name(db.name + ".part")
        shutil.copyfile(template, part)
        now = int(time.time() * 1000)
        with sqlite3.connect(part) as conn:
            conn.execute("UPDATE experiments SET artifact_location = ?, creation_time = ?, "
                         "last_update_time = ? WHERE experiment_id = 0",
                         (_default_artifact_location(), now, now))
        conn.close()
        part.replace(db)
    except Exception as e:  # noqa: BLE001 - MLflow creates the store itself, as before
        import logging

        logging.getLogger(__name__).debug("no store template (%s): MLflow creates %s", e, db)
        db.with_name(db.name + ".part").unlink(missing_ok=True)


def _default_artifact_location() -> str:
    """Experiment 0's artifact location as MLflow sets it when it creates a store here."""
    from mlflow.store.tracking import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
    from mlflow.tracking._tracking_service.utils import _SERVER_ARTIFACT_ROOT_ENV_VAR
    from mlflow.utils.uri import append_to_uri_path, resolve_uri_if_local

    root = os.environ.get(_SERVER_ARTIFACT_ROOT_ENV_VAR, DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH)
    return str(append_to_uri_path(resolve_uri_if_local(root), "0"))


def artifact_location(uri: str, experiment: str) -> Optional[str]:
    """Artifacts of a sqlite store live beside it (outputs/mlartifacts), not in ./mlruns of
    whatever directory the run was started from. Servers keep their own default."""
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    return (db.parent / "mlartifacts" / experiment).resolve().as_uri()


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as MLflow params: {"train": {"lr": 1}} -> {"train.lr": 1}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def experiment_tags() -> dict[str, str]:
    """A model-training experiment, its description, and the runs-table view that shows what
    runs are compared on (summary metrics, key choices, data), sorted by start so sweeps stay
    grouped (the UI's own default shows none of them)."""
    now = int(time.time() * 1000)
    state = {"selectedColumns": VIEW_COLUMNS, "orderByKey": "attributes.start_time",
             "orderByAsc": False}
    view = {"name": "llama_fsdp: throughput, memory, loss", "createdAt": now, "updatedAt": now,
            "state": json.dumps(state)}
    return {"mlflow.experimentKind": EXPERIMENT_KIND, VIEW_TAG: json.dumps(view),
            "mlflow.note.content": "Fine-tuning runs of llama_fsdp. A sweep is one row (expand "
            "it for its points); the summary/* metrics are each run's steady-state numbers."}


def runs_page(uri: str, experiment_id: str, base: str = "http://127.0.0.1:5000") -> str:
    """The URL of the experiment's runs table with the llama_fsdp view (for `mlflow ui`)."""
    host = uri if uri.startswith("http") else base
    return f"{host}/#/experiments/{experiment_id}/runs?viewStateShareKey={VIEW}"
