"""What the driver does once, before any rank trains (``prepare_job``: the launchers call it
where their kind does the job's once-only duties, launchers/base.py).

The run directory is owned first (one live launch per directory), and a run with nothing left
to train stops there. Everything that needs no process group happens here, so bad input fails
in seconds with the fix and ranks never wait behind a barrier: the tracking store is reached
(or the run refused, in about ten seconds), HF weights named by a hub id are downloaded once,
the data is read, validated, tokenized into the cache and packed exactly as the ranks will pack
it, and the MLflow run is created. The ranks then read prepared files only (they run with
HF_HUB_OFFLINE=1).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from ..checkpoint.layout import resume_candidates
from ..data import check_record as warm
from ..config.hf_dir import model_file_problems, resolve_hf_dir
from ..run.ownership import own
from ..config.status import FINISHED
from ..config.rundir import CONFIG_FILE, RunDir, read_run_status
from ..run.spec import RunSpec
from ..tracking.sweep import parent_run, point_tags
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
from ..tracking.view import STATUS_TAG, command_note

log = logging.getLogger(__name__)


class PrepareError(ValueError):
    """Input that cannot train; the message names what is wrong and the fix."""


@dataclasses.dataclass
class PreparedRun:
    spec: RunSpec  # with model.path resolved to a local directory
    data_stats: dict[str, float]
    owner: Any = None  # the launch's hold on the run directory (owner.Ownership), prepare_job's


def prepare_job(spec: RunSpec, *, held: contextlib.ExitStack, command: str
                ) -> Optional[PreparedRun]:
    """The job's once-only duties before any rank trains, wherever the launcher runs them:
    own the run directory (until ``held`` closes), stop at a run that has nothing left to train
    (None), then ``prepare``."""
    owner = own_run_dir(spec, held, command)
    if finished_run(spec):
        return None
    return dataclasses.replace(prepare(spec, command=command), owner=owner)


def own_run_dir(spec: RunSpec, held: contextlib.ExitStack, command: str) -> Any:
    """Hold the run directory until ``held`` closes; say so when a dead owner's is taken over."""
    owner = held.enter_context(own(spec.output_dir, command=command))
    if owner.previous:
        log.warning("the launch that held %s before (pid %s on %s) ended without letting it go "
                    "(killed, or its host went down): taking it over%s", spec.output_dir,
                    owner.previous.get("pid"), owner.previous.get("host"),
                    "; resume=auto continues from its newest checkpoint"
                    if spec.resume == "auto" else "")
    return owner


def finished_run(spec: RunSpec) -> bool:
    """A single run launched again into its directory (resume=auto) whose last attempt finished
    every step it is asked for now: nothing to start. A larger train.max_steps trains on."""
    if spec.sweep_id is not None or spec.resume != "auto":
        return False
    status = read_run_status(spec.output_dir)
    target = spec.train.stop_after or spec.train.max_steps
    if status.get("status") != FINISHED or int(status.get("step", 0)) < target:
        return False
    log.info("this run finished at step %d (train.max_steps=%d) in %s: nothing to train, "
             "nothing launched. Raise train.max_steps to train on from its last checkpoint, or "
             "give a new output_dir", status["step"], spec.train.max_steps, spec.output_dir)
    return True


def prepare(spec: RunSpec, *, command: str) -> PreparedRun:
    """Reach the tracking store, fetch weights, prepare the data, create the MLflow run."""
    check_callbacks(spec)
    reachable = check_tracking(spec) if spec.tracking.enabled else False
    spec = resolve_model(spec)
    data = prepare_data(spec)
    spec = replan_for_records(spec, data.stats)
    Path(spec.output_dir).mkdir(parents=True, exist_ok=True)
    RunDir(spec.output_dir).config.write_text(spec.config_yaml)
    if spec.tracking.enabled:
        start_run(spec, command=command, deliver=reachable, datasets=dataset_inputs(spec, data))
    return PreparedRun(spec, data.stats)


def replan_for_records(spec: RunSpec, stats: dict[str, float]) -> RunSpec:
    """CUDA's flash varlen backward allocates per record of a micro-batch
    (plan/activations.py: varlen_backward_bytes), which the plan counts as one record per row
    until the data is known. Now it is: the spec carries the fullest micro-batch's records
    (the ``train.batch_size`` fullest rows' records: a row's padding joins its last record), the
    ranks' plan counts them, the new peak is printed where the term moves it, and a run that no
    longer fits is refused here, before any rank starts, with the plan's fixes."""
    from ..plan import PlanError, check_fits, flash_varlen_runs, make_plan

    per_row = int(stats.get("records_per_row_max", 0))
    records = int(stats.get("records_per_micro_batch_max",
                            spec.train.batch_size * per_row))
    if not records or not flash_varlen_runs(spec.model, spec.device):
        return spec
    grown = dataclasses.replace(spec, records_per_micro_batch=records)
    before, plan = make_plan(spec), make_plan(grown)
    if plan.predicted_peak_bytes >= 1.01 * before.predicted_peak_bytes:
        log.info("plan with the data: up to %d records in a micro-batch (%d in the fullest row) "
                 "grow flash varlen's backward workspace: predicted peak %.2f GB (was %.2f GB), "
                 "in %s", records, per_row, plan.predicted_peak_gb,
                 before.predicted_peak_gb, plan.peak_phase)
    if not plan.fits:
        try:
            check_fits(grown, plan)  # the fixes (or force=true's warning)
        except PlanError as e:
            raise PlanError(
                f"with the data, flash varlen's backward holds a workspace for up to {records} "
                f"records a micro-batch ({per_row} in the fullest row), and the run no "
                f"longer fits (the plan printed above counted one record per row). Rows of "
                f"fewer, longer records need less.\n{e}") from None
    return grown


def check_callbacks(spec: RunSpec) -> None:
    """train.callbacks imported here, once: a bad one is named before any rank starts."""
    from ..run.callbacks import problems

    if found := problems(spec.train.callbacks):
        raise PrepareError("; ".join(found))


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


def resolve_model(spec: RunSpec) -> RunSpec:
    """model.path as a local directory: a hub name is downloaded here, once."""
    path = spec.model.path
    if not path or Path(path).expanduser().is_dir():
        return spec
    log.info("downloading %s (config, safetensors, tokenizer) ...", path)
    local = resolve_hf_dir(path)
    if problems := model_file_problems(local):  # a damaged download: named before launch
        raise PrepareError("model.path: " + "; ".join(problems))
    return dataclasses.replace(spec, model=dataclasses.replace(spec.model, path=str(local)))


def check_data(spec: RunSpec) -> Any:
    """Read, validate, tokenize (into the cache) and pack the data as rank 0 will, once, here.

    Everything about the data that can be wrong fails now, in seconds, naming the file, the
    record and the fix: files and globs, formats and columns (layouts that cannot be mapped),
    too few records for the train / eval split, records without any target token, a tokenizer
    whose ids do not fit model.vocab_size, a model directory without its tokenizer. The tokenizer
    is model.path's own unless data.tokenizer is set (spec.model.path is a local directory by
    now: ``resolve_model`` ran first). The notes about the data (split, tokenizer, advice) are
    printed here, once; the ranks then find the tokenized data in the cache.
    """
    from ..data import build_data

    t0 = time.perf_counter()
    try:
        data = build_data(spec.data, **spec.data_kwargs(dp_rank=0, announce=True))
    except (ValueError, FileNotFoundError, OSError) as e:
        raise PrepareError(f"data: {e}") from e
    _log_ready(time.perf_counter() - t0, len(data.train), data.batches_per_epoch,
               len(data.eval), data.info)
    return data


def prepare_data(spec: RunSpec) -> Any:
    """``check_data``, or for inputs checked before, the record of that check (data/warm.py):
    the same notes and numbers, without loading transformers, datasets or the data here."""
    t0 = time.perf_counter()
    kwargs = spec.data_kwargs(dp_rank=0, announce=True)
    cache_dir = kwargs.pop("cache_dir")
    known = warm.lookup(spec.data, cache_dir=cache_dir, **kwargs)
    if known is None:
        data = check_data(spec)
        try:
            warm.record(spec.data, data, cache_dir=cache_dir, **kwargs)
        except OSError as e:  # a read-only cache: the next launch checks the data again
            log.debug("no record of the data's check: %s", e)
        return data
    known.announce()
    _log_ready(time.perf_counter() - t0, known.train_rows, known.batches_per_epoch,
               known.eval_rows, known.info)
    return known


def _log_ready(seconds: float, train_rows: int, batches: int, eval_rows: int, info: Any) -> None:
    log.info("data ready in %.1fs: %d training rows (%d micro-batches per rank per epoch), %d "
             "held-out rows; tokenizer %s (%s)", seconds, train_rows, batches, eval_rows,
             info.tokenizer, info.tokenizer_source)


def run_tags(spec: RunSpec, command: str) -> dict[str, str]:
    """The run's tags: where and what it ran; a sweep point names its parent run."""
    tags = {"git_commit": spec.git_commit, "output_dir": spec.output_dir,
            "launch_host": socket.gethostname(), "world_size": str(spec.world_size),
            "strategy": spec.strategy, "precision": spec.precision.name,
            "attention": spec.model.attn_implementation,  # auto values, resolved for this run
            # until rank 0 starts: a SLURM job waits in its queue
            STATUS_TAG: "queued" if spec.placement.queued else "starting",
            "mlflow.note.content": command_note(
                command, f"Point {spec.run_name} of sweep {spec.sweep_id}; run alone with:"
                if spec.sweep_id else "")}
    if spec.sweep_id:
        tags["sweep_id"] = spec.sweep_id
        tags.update(point_tags(spec.sweep_point))
    if spec.sweep_dir and (parent := parent_run(spec.sweep_dir)):
        tags["mlflow.parentRunId"] = parent
    return tags


def dataset_inputs(spec: RunSpec, data: Any) -> list[dict[str, Any]]:
    """The train and eval splits as MLflow dataset inputs: name, digest (the tokenized cache's
    key: source files, options and tokenizer), source, columns and size, so runs on different
    data differ visibly in the runs table."""
    cfg, info, stats = spec.data, data.info, data.stats
    match cfg.name:
        case "synthetic":
            kind, source = "code", {"generator": "llama_fsdp.data.synthetic", "seed": cfg.seed}
        case "hf":
            kind = "hugging_face"
            source = {"path": cfg.path, "config_name": cfg.subset, "split": cfg.split,
                      "revision": cfg.revision}
        case _:
            kind, source = "local", {"uri": str(Path(cfg.path).expanduser().resolve())}
    digest = Path(info.cache_path).name.rsplit("-", 1)[-1][:16]
    name = "synthetic" if cfg.name == "synthetic" else Path(str(cfg.path)).stem
    columns = {"mlflow_colspec": [{"type": "long", "name": "input_ids", "required": True},
                                  {"type": "long", "name": "labels", "required": True}]}
    out = []
    for split, context, records, extra in (
            ("train", "training", info.train_records, {"tokens": stats["train_tokens"],
                                                       "rows": stats["train_rows"]}),
            ("eval", "evaluation", info.eval_records, {"rows": stats["eval_rows"]})):
        profile = {"num_rows": records, "format": info.format, "tokenizer": info.tokenizer,
                   "seq_len": spec.train.seq_len, **extra}
        out.append({"name": f"{name}-{split}", "digest": digest, "source_type": kind,
                    "source": json.dumps({**source, "split": split} if kind == "code" else source),
                    "schema": json.dumps(columns), "profile": json.dumps(profile),
                    "context": context})
    return out


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
        spool.append(events.Params(dict(sorted(flat.items()))))
        spool.append(events.Text(spec.config_yaml, CONFIG_FILE))
        if datasets:
            spool.append(events.Inputs(datasets))
    if deliver and deliver_pending(spec.output_dir, deadline_s=START_DELIVERY_S,
                                   uri=spec.tracking_uri):
        log.warning("the MLflow run is not created yet (the store does not answer); it will be "
                    "when it does")
