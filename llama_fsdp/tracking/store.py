"""The MLflow store: opening a client safely, where artifacts go, and the experiment's view."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

# MLflow's own HTTP retries would hold a call for minutes; the shipper retries instead.
FAST_FAIL_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
EXPERIMENT_KIND = "finetuning"  # mlflow.experimentKind: a model-training experiment
VIEW = "llama_fsdp"  # a saved runs-table view: open the runs page with ?viewStateShareKey=llama_fsdp
VIEW_TAG = f"mlflow.sharedViewState.{VIEW}"
VIEW_COLUMNS = ["attributes.`Dataset`", "attributes.`Models`",
                *(f"metrics.`summary/{m}`" for m in ("tokens_per_sec", "tokens_per_sec_per_device",
                                                     "mfu", "peak_memory_gb",
                                                     "predicted_peak_memory_gb", "final_loss",
                                                     "eval_loss")),
                *(f"params.`{p}`" for p in ("model.name", "finetune.method", "optim.name",
                                            "sharding.strategy", "precision.name",
                                            "train.batch_size")),
                "metrics.`trainable_params`", "metrics.`total_params`",  # what the method trains
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
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)  # the store is created and migrated here
    return client


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
