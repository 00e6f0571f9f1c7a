"""The run's MLflow side before any rank starts: the store reached (or the run refused), and the
MLflow run created, or continued, through the run's spool."""
from __future__ import annotations

import logging
import os
import socket
from typing import Any, Optional

from omegaconf import OmegaConf

from ..checkpoint.layout import resume_candidates
from ..config.rundir import CONFIG_FILE
from ..config.status import QUEUED, STARTING
from ..run.spec import RunSpec
from ..tracking import (
    FAST_FAIL_ENV,
    START_DELIVERY_S,
    Spool,
    deliver_pending,
    events,
    flatten,
    open_client,
    read_run_file,
    write_run_file,
)
from ..tracking.delivery import RunRefused
from ..tracking.sweep import parent_run, point_tags
from ..tracking.view import STATUS_TAG, command_note
from .errors import PrepareError

log = logging.getLogger(__name__)


def check_tracking(spec: RunSpec) -> bool:
    """Whether the store answers; refuse (or, with tracking.allow_offline, warn) when not."""
    problem = probe_store(spec.tracking_uri)
    if problem is None:
        return True
    text = (f"the MLflow tracking store {spec.tracking_uri} does not answer ({problem})")
    if spec.tracking.allow_offline:
        log.warning("%s; training anyway (tracking.allow_offline=true): metrics wait in the run's "
                    "tracking/ folder and are delivered when it answers", text)
        return False
    raise PrepareError(f"{text}. Start it (e.g. `mlflow server --port 5000`), fix tracking.uri, "
                       "set tracking.allow_offline=true to train now and deliver the metrics "
                       "later, or tracking.enabled=false")


def probe_store(uri: str) -> Optional[str]:
    """None if the store answers a search within ~10 s, else the reason."""
    os.environ.update(FAST_FAIL_ENV)
    try:
        open_client(uri).search_experiments(max_results=1)
    except Exception as e:  # noqa: BLE001 - any failure means: not reachable
        first = str(e).strip().splitlines()
        return (first[0] if first else type(e).__name__)[:300]
    return None


def run_tags(spec: RunSpec, command: str) -> dict[str, str]:
    """The run's tags: where and what it ran; a sweep point names its parent run."""
    tags = {"git_commit": spec.git_commit, "output_dir": spec.output_dir,
            "launch_host": socket.gethostname(), "world_size": str(spec.world_size),
            "strategy": spec.strategy, "precision": spec.precision.name,
            "attention": spec.model.attn_implementation,  # auto values, resolved for this run
            # until rank 0 starts: a SLURM job waits in its queue
            STATUS_TAG: QUEUED if spec.placement.queued else STARTING,
            "mlflow.note.content": command_note(
                command, f"Point {spec.run_name} of sweep {spec.sweep_id}; run alone with:"
                if spec.sweep_id else "")}
    if spec.sweep_id:
        tags["sweep_id"] = spec.sweep_id
        tags.update(point_tags(spec.sweep_point))
    if spec.sweep_dir and (parent := parent_run(spec.sweep_dir)):
        tags["mlflow.parentRunId"] = parent
    return tags


def start_run(spec: RunSpec, *, command: str, deliver: bool = True,
              datasets: Optional[list[dict[str, Any]]] = None) -> None:
    """Create the MLflow run (or continue the one of this run dir) through the spool, with its
    data as dataset inputs, and deliver it now if the store answers (``deliver``)."""
    spool = Spool(spec.output_dir)
    info = read_run_file(spec.output_dir)
    continuing = bool(info.get("run_id")) and info.get("tracking_uri") == spec.tracking_uri
    if continuing and not resume_candidates(spec.resume, spec.output_dir):
        # training starts again at step 0: in the old run its steps would be logged twice
        log.warning("this run directory's MLflow run %s has no checkpoint to continue from "
                    "(save.every_steps=0?): training starts at step 0, in a new MLflow run; the "
                    "old one is kept", info["run_id"])
        continuing = False
    if info.get("run_id") and not continuing and deliver_pending(
            spec.output_dir, deadline_s=START_DELIVERY_S):
        # the spool's undelivered events name the old run: a new run queued behind them would
        # never be created
        raise PrepareError(
            f"{spec.output_dir} holds tracking events not yet delivered to its MLflow run "
            f"{info['run_id']} at {info.get('tracking_uri')}: deliver them first with "
            f"`python -m llama_fsdp.tracking {spec.output_dir}`, or use a new output_dir")
    if continuing:
        log.info("continuing MLflow run %s", info["run_id"])
        spool.append(events.Running())
        spool.append(events.Tags({"resumed": "true"}))
    else:
        write_run_file(spec.output_dir, {"tracking_uri": spec.tracking_uri})  # run_id: once made
        spool.append(events.Create(spec.tracking.experiment, spec.run_name,
                                   run_tags(spec, command)))
        flat = flatten(OmegaConf.to_container(OmegaConf.create(spec.config_yaml)))  # type: ignore[arg-type]
        flat.pop("output_dir", None)  # a tag: it differs for every run
        if spec.recipe:  # the values in use, not null, and where each came from
            flat.update({**spec.recipe.values, **spec.recipe.params()})
        spool.append(events.Params(dict(sorted(flat.items()))))
        spool.append(events.Text(spec.config_yaml, CONFIG_FILE))
        if datasets:
            spool.append(events.Inputs(datasets))
    if not deliver:
        return
    try:
        left = deliver_pending(spec.output_dir, deadline_s=START_DELIVERY_S,
                               uri=spec.tracking_uri, refused="raise")
    except RunRefused as e:  # before any rank trains, not after
        raise PrepareError(f"{e}. Fix tracking.experiment (or restore or delete the experiment "
                           "of that name in MLflow's trash: `mlflow gc`), or set "
                           "tracking.enabled=false") from None
    if left:
        log.warning("the MLflow run is not created yet (the store does not answer); it will be "
                    "when it does")

