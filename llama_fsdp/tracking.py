"""Rank-0 side effects behind one object each: MLflow tracking and the console.

Rank 0 holds the real objects; every other rank holds the do-nothing twins with the same
methods, so training code never asks which rank it is on.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

log = logging.getLogger(__name__)

RUN_ID_FILE = "mlflow_run.json"


def artifact_location(uri: str, experiment: str) -> Optional[str]:
    """Artifacts of a sqlite store live beside it (outputs/mlartifacts), not in ./mlruns of
    whatever directory the run was started from. Servers keep their own default."""
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    return (db.parent / "mlartifacts" / experiment).resolve().as_uri()


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class MlflowTracker:
    """One MLflow run per launch; a resumed run (same output dir) continues the same MLflow run."""

    def __init__(self, *, uri: str, experiment: str, run_name: str, output_dir: str,
                 tags: dict[str, str], config_yaml: str):
        import mlflow
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(
            experiment, artifact_location=artifact_location(uri, experiment))
        self._id_file = Path(output_dir) / RUN_ID_FILE
        self.run_id = self._existing_run(exp_id)
        self.resumed = self.run_id is not None
        if self.run_id is None:
            run = self.client.create_run(exp_id, run_name=run_name, tags=tags)
            self.run_id = run.info.run_id
            self._id_file.parent.mkdir(parents=True, exist_ok=True)
            self._id_file.write_text(json.dumps({"run_id": self.run_id, "tracking_uri": uri}))
            self._log_config(config_yaml)
        else:
            self.client.update_run(self.run_id, status="RUNNING")
            self.client.set_tag(self.run_id, "resumed", "true")
        self.experiment_id = exp_id
        self._mlflow = mlflow

    def _existing_run(self, exp_id: str) -> Optional[str]:
        if not self._id_file.exists():
            return None
        saved = json.loads(self._id_file.read_text())
        if saved.get("tracking_uri") != self.uri:
            return None
        return saved["run_id"]

    def _log_config(self, config_yaml: str) -> None:
        from mlflow.entities import Param

        flat = flatten(OmegaConf.to_container(OmegaConf.create(config_yaml)))  # type: ignore[arg-type]
        params = [Param(k, str(v)[:6000]) for k, v in sorted(flat.items())]
        for i in range(0, len(params), 100):  # the store takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_text(self.run_id, config_yaml, "config.yaml")

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        self.client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in params.items()])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()]
        )

    def set_tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, v)

    def log_artifact(self, path: str) -> None:
        self.client.log_artifact(self.run_id, path)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


def mark_run_failed(output_dir: str) -> None:
    """Set the run recorded in output_dir to FAILED if it is still RUNNING."""
    from mlflow.tracking import MlflowClient

    id_file = Path(output_dir) / RUN_ID_FILE
    if not id_file.exists():
        return
    saved = json.loads(id_file.read_text())
    client = MlflowClient(tracking_uri=saved["tracking_uri"])
    if client.get_run(saved["run_id"]).info.status == "RUNNING":
        client.set_terminated(saved["run_id"], status="FAILED")


class NullTracker:
    """What ranks other than 0 hold: the same methods, doing nothing."""

    run_id: Optional[str] = None
    experiment_id: Optional[str] = None
    uri: Optional[str] = None
    resumed = False

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_artifact(self, path: str) -> None: ...
    def finish(self, status: str = "FINISHED") -> None: ...


class Console:
    """Rank 0's progress bar and messages."""

    def __init__(self, total: int, initial: int = 0):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step",
                        dynamic_ncols=True, file=sys.stderr, mininterval=0.5)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        self.bar.n = step
        self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                             tok_s=f"{metrics['tokens_per_sec']:.0f}", refresh=False)
        self.bar.refresh()

    def info(self, msg: str, *args: Any) -> None:
        self.bar.clear()
        log.info(msg, *args)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class NullConsole:
    def update(self, step: int, metrics: dict[str, float]) -> None: ...
    def info(self, msg: str, *args: Any) -> None: ...
    def close(self) -> None: ...
