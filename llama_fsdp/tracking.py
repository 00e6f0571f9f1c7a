"""MLflow tracking off the training path, and rank 0's console.

Rank 0 appends every tracking event (params, metrics, tags, files, status) to a spool in the
run directory, ``<run>/tracking/spool.jsonl``, and a background shipper thread delivers the
spool to MLflow. A step never waits for MLflow: an outage (server down, sqlite locked by
parallel sweep jobs) only grows the spool; delivery resumes when the store answers. What is
left when a rank ends is delivered by the launcher, or later with

    python -m llama_fsdp.tracking <run dir>

so nothing is lost. Delivery is at least once, in order; ``<run>/tracking/shipped`` holds how
much of the spool has been delivered. The MLflow run itself is created before launch by the
driver (prepare.py), through the same spool, so an unreachable store is reported in seconds.

Every other rank holds ``NullTracker``, with the same methods doing nothing, so training code
never asks which rank it is on.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from .rundir import RunDir, replace_text

log = logging.getLogger(__name__)

SPOOL, SHIPPED, RUN_FILE, LOCK = "spool.jsonl", "shipped", "run.json", "ship.lock"
# MLflow's own HTTP retries would hold a call for minutes; the shipper retries instead.
FAST_FAIL_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
PERMANENT_ERRORS = ("INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "BAD_REQUEST",
                    "RESOURCE_ALREADY_EXISTS", "INVALID_STATE")
METRICS_PER_BATCH, PARAMS_PER_BATCH = 1000, 100
EXPERIMENT_KIND = "finetuning"  # mlflow.experimentKind: a model-training experiment
VIEW = "llama_fsdp"  # a saved runs-table view: open the runs page with ?viewStateShareKey=llama_fsdp
VIEW_TAG = f"mlflow.sharedViewState.{VIEW}"
VIEW_COLUMNS = ["attributes.`Dataset`", "attributes.`Models`",
                *(f"metrics.`summary/{m}`" for m in ("tokens_per_sec", "tokens_per_sec_per_device",
                                                     "mfu", "peak_memory_gb",
                                                     "predicted_peak_memory_gb", "final_loss",
                                                     "eval_loss")),
                *(f"params.`{p}`" for p in ("model.name", "sharding.strategy", "precision.name",
                                            "train.batch_size")),
                "tags.`derived.world_size`"]
MODEL_MAX_BYTES = 20 * 10**9  # larger exports are linked by path, not copied into MLflow


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


def tracking_dir(output_dir: str | Path) -> Path:
    return RunDir(output_dir).tracking


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


# --- the spool --------------------------------------------------------------------------------


class Spool:
    """Append-only JSON lines in the run dir, and how far they have been delivered."""

    def __init__(self, output_dir: str | Path):
        self.dir = tracking_dir(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path, self._offset_file = self.dir / SPOOL, self.dir / SHIPPED
        self._lock = threading.Lock()

    def append(self, event: dict[str, Any]) -> None:
        line = (json.dumps(event, default=str) + "\n").encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)  # one write of a whole line: never a torn event
            finally:
                os.close(fd)

    def shipped(self) -> int:
        try:
            return int(self._offset_file.read_text() or 0)
        except (OSError, ValueError):
            return 0

    def mark_shipped(self, offset: int) -> None:
        replace_text(self._offset_file, str(offset))

    def pending(self, limit: int = 5000) -> list[tuple[int, dict[str, Any]]]:
        """(end offset, event) of up to ``limit`` undelivered events, in order."""
        if not self.path.exists():
            return []
        out, offset = [], self.shipped()
        with self.path.open("rb") as f:
            f.seek(offset)
            for raw in f:
                if not raw.endswith(b"\n") or len(out) >= limit:
                    break  # a line still being written, or enough for one round
                offset += len(raw)
                out.append((offset, json.loads(raw)))
        return out

    def backlog(self) -> int:
        return max(0, (self.path.stat().st_size if self.path.exists() else 0) - self.shipped())

    @contextlib.contextmanager
    def exclusive(self, wait: bool) -> Iterator[bool]:
        """Hold the shipping lock (one deliverer at a time); yields False if busy and not wait."""
        fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)


# --- delivery ---------------------------------------------------------------------------------


def _permanent(err: Exception) -> bool:
    """An error the store will give again (a changed param value, a deleted run)."""
    return getattr(err, "error_code", None) in PERMANENT_ERRORS


class Delivery:
    """Delivers spooled events to one MLflow store; knows the run once it exists."""

    def __init__(self, spool: Spool, uri: str):
        os.environ.update(FAST_FAIL_ENV)
        self.spool, self.uri = spool, uri
        self.client = open_client(uri)
        self.run_id = read_run_file(spool.dir.parent).get("run_id")

    def ship(self, events: list[tuple[int, dict[str, Any]]]) -> None:
        """Deliver events in order, marking each delivered group; raises on a transient error
        (the rest stays in the spool)."""
        i = 0
        while i < len(events):
            kind = events[i][1]["t"]
            j = i + 1
            if kind == "metrics":  # consecutive metric events go in batches
                n = len(events[i][1]["m"])
                while j < len(events) and events[j][1]["t"] == "metrics" and \
                        n + len(events[j][1]["m"]) <= METRICS_PER_BATCH:
                    n += len(events[j][1]["m"])
                    j += 1
            group = [e for _, e in events[i:j]]
            try:
                self._deliver(kind, group)
            except Exception as e:  # noqa: BLE001 - classified: dropped or retried
                if not _permanent(e):
                    raise
                log.warning("MLflow refused a %s event (%s); it is skipped", kind,
                            str(e).splitlines()[0][:300])
            self.spool.mark_shipped(events[j - 1][0])
            i = j

    def _deliver(self, kind: str, group: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        c = self.client
        if kind == "create":
            self._create(group[0])
            return
        if self.run_id is None:
            raise RuntimeError("no MLflow run yet")  # transient: the create event comes first
        match kind:
            case "metrics":
                c.log_batch(self.run_id, metrics=[Metric(k, float(v), e["ts"], e["step"])
                                                  for e in group for k, v in e["m"].items()])
            case "params":
                params = [Param(k, str(v)[:6000]) for k, v in group[0]["p"].items()]
                for at in range(0, len(params), PARAMS_PER_BATCH):
                    c.log_batch(self.run_id, params=params[at:at + PARAMS_PER_BATCH])
            case "tags":
                c.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in group[0]["tags"].items()])
            case "text":
                c.log_text(self.run_id, group[0]["text"], group[0]["file"])
            case "artifacts":
                c.log_artifacts(self.run_id, group[0]["dir"], group[0].get("path"))
            case "model":
                self._log_model(group[0])
            case "inputs":
                c.log_inputs(self.run_id, datasets=[_dataset_input(d) for d in group[0]["datasets"]])
            case "status":
                c.set_terminated(self.run_id, status=group[0]["status"], end_time=group[0]["ts"])
            case "running":
                c.update_run(self.run_id, status="RUNNING")
            case other:
                raise ValueError(f"unknown tracking event {other!r}")

    def _log_model(self, e: dict[str, Any]) -> None:
        """The exported HF directory as the run's logged model (its Models column and tab):
        downloadable and registrable from the UI."""
        from mlflow.entities import LoggedModelOutput

        c = self.client
        exp_id = c.get_run(self.run_id).info.experiment_id
        model = c.create_logged_model(exp_id, name=e["name"], source_run_id=self.run_id,
                                      model_type="transformers-llama",
                                      params={k: str(v) for k, v in e.get("params", {}).items()})
        c.log_model_artifacts(model.model_id, e["dir"])
        c.finalize_logged_model(model.model_id, "READY")
        c.log_outputs(self.run_id, [LoggedModelOutput(model.model_id, e["step"])])

    def _create(self, e: dict[str, Any]) -> None:
        """The run (and its experiment) for a spool that starts without one."""
        if self.run_id is not None:
            return
        c = self.client
        exp = c.get_experiment_by_name(e["experiment"])
        exp_id = exp.experiment_id if exp else c.create_experiment(
            e["experiment"], artifact_location=artifact_location(self.uri, e["experiment"]))
        if exp is None or VIEW_TAG not in exp.tags:
            for key, value in experiment_tags().items():
                c.set_experiment_tag(exp_id, key, value)
        run = c.create_run(exp_id, run_name=e["run_name"], tags=e.get("tags") or {},
                           start_time=e["ts"])
        self.run_id = run.info.run_id
        where = self.spool.dir.parent
        write_run_file(where, {**read_run_file(where), "run_id": self.run_id,
                               "experiment_id": exp_id, "tracking_uri": self.uri})


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


def _dataset_input(d: dict[str, Any]) -> Any:
    from mlflow.entities import Dataset, DatasetInput, InputTag

    ds = Dataset(name=d["name"], digest=d["digest"], source_type=d["source_type"],
                 source=d["source"], schema=d.get("schema"), profile=d.get("profile"))
    return DatasetInput(ds, tags=[InputTag("mlflow.data.context", d.get("context", "train"))])


def read_run_file(output_dir: str | Path) -> dict[str, Any]:
    path = tracking_dir(output_dir) / RUN_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def write_run_file(output_dir: str | Path, info: dict[str, Any]) -> None:
    path = tracking_dir(output_dir) / RUN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_text(path, json.dumps(info))


START_DELIVERY_S = 30.0  # how long a new run's (or sweep's) first events may take to deliver


def close_run(output_dir: str | Path, status: str, *, deadline_s: float) -> int:
    """End the run's MLflow record with ``status`` (FAILED, KILLED) after what is spooled, and
    deliver; returns the undelivered bytes."""
    Spool(output_dir).append({"t": "status", "status": status, "ts": int(time.time() * 1000)})
    return deliver_pending(output_dir, deadline_s=deadline_s)


def deliver_pending(output_dir: str | Path, *, deadline_s: float, uri: Optional[str] = None,
                    wait_for_lock: bool = True, patience_s: float = 10.0) -> int:
    """Deliver what the spool holds until it is empty, the deadline passes, or the store has
    failed for ``patience_s`` without a success; returns the undelivered bytes (0: everything
    is in MLflow)."""
    spool = Spool(output_dir)
    uri = uri or read_run_file(output_dir).get("tracking_uri")
    if uri is None:
        return spool.backlog()
    end, delay = time.monotonic() + deadline_s, 0.5
    with spool.exclusive(wait_for_lock) as mine:
        if not mine:
            return spool.backlog()
        delivery, failing_since = None, None
        while (events := spool.pending()) and time.monotonic() < end:
            try:
                # opening a sqlite store migrates it: parallel first opens can collide
                delivery = delivery or Delivery(spool, uri)
                delivery.ship(events)
                delay, failing_since = 0.5, None
            except Exception as e:  # noqa: BLE001 - transient: wait and try again
                log.debug("delivery failed: %s", e)
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > patience_s:
                    break
                time.sleep(min(delay, max(0.0, end - time.monotonic())))
                delay = min(delay * 2, 10.0)
    return spool.backlog()


class Shipper(threading.Thread):
    """Rank 0's background delivery: every ``interval_s``, whatever the spool holds."""

    def __init__(self, spool: Spool, uri: str, interval_s: float = 1.0):
        super().__init__(name="mlflow-shipper", daemon=True)
        self.spool, self.uri, self.interval_s = spool, uri, interval_s
        self._wake, self._halt = threading.Event(), threading.Event()
        self.failures = 0
        self.last_error = ""

    def run(self) -> None:
        delivery, delay = None, self.interval_s
        with self.spool.exclusive(wait=True):
            while not self._halt.is_set():
                self._wake.wait(delay)
                self._wake.clear()
                try:
                    delivery = delivery or Delivery(self.spool, self.uri)
                    while events := self.spool.pending():
                        delivery.ship(events)
                    delay, self.failures = self.interval_s, 0
                except Exception as e:  # noqa: BLE001 - transient: back off, keep the spool
                    self.failures += 1
                    self.last_error = str(e).splitlines()[0][:300] if str(e) else repr(e)
                    if self.failures == 1:
                        log.warning("MLflow at %s is not answering (%s); training goes on and "
                                    "the metrics wait in %s", self.uri, self.last_error,
                                    self.spool.path)
                    delay = min(self.interval_s * 2 ** self.failures, 30.0)

    def nudge(self) -> None:
        self._wake.set()

    def stop(self, timeout_s: float) -> bool:
        """Deliver what is left within timeout_s; True if the spool is empty."""
        end = time.monotonic() + timeout_s
        while self.spool.backlog() and time.monotonic() < end and self.is_alive():
            self._wake.set()
            time.sleep(0.1)
        self._halt.set()
        self._wake.set()
        self.join(timeout=max(0.0, end - time.monotonic()) + 1.0)
        return self.spool.backlog() == 0


# --- what rank 0 holds ------------------------------------------------------------------------


class SystemSampler(threading.Thread):
    """CPU, memory, disk, network and (with nvidia-ml-py) GPU utilisation and memory of rank 0's
    node every ``interval_s``, as MLflow's system/* metrics (its System metrics tab), through
    the spool like every other metric. MLflow's own monitors do the measuring."""

    def __init__(self, tracker: "Tracker", interval_s: float):
        super().__init__(name="system-metrics", daemon=True)
        from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
        from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
        from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

        self.tracker, self.interval_s = tracker, interval_s
        self.monitors = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
        try:
            from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

            self.monitors.append(GPUMonitor())
        except (ImportError, RuntimeError) as e:  # no NVML, or no GPU
            log.debug("no GPU system metrics: %s", e)
        self._halt = threading.Event()

    def run(self) -> None:
        sample = 0
        while not self._halt.wait(self.interval_s):
            metrics: dict[str, float] = {}
            for m in self.monitors:
                try:
                    m.collect_metrics()
                    metrics.update(m.aggregate_metrics())
                finally:
                    m.clear_metrics()
            self.tracker.log_metrics({f"system/{k}": v for k, v in metrics.items()}, step=sample)
            sample += 1

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


def _system_sampler(tracker: "Tracker", interval_s: float) -> Optional[SystemSampler]:
    try:
        return SystemSampler(tracker, interval_s)
    except Exception as e:  # noqa: BLE001 - tracking never stops training
        log.warning("system metrics are off for this run: MLflow's monitors did not start "
                    "(%s: %s)", type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
        return None


class Tracker:
    """Rank 0's tracker: each call appends to the spool (microseconds); the shipper delivers."""

    def __init__(self, output_dir: str, uri: str, *, flush_timeout_s: float = 30.0,
                 system_metrics_s: Optional[float] = None):
        self.output_dir, self.uri = output_dir, uri
        self.spool = Spool(output_dir)
        self.flush_timeout_s = flush_timeout_s
        # The sampler's MLflow monitors are imported here, before the shipper thread starts and
        # imports MLflow for its client: two threads importing the mlflow package at once can
        # get it partially initialized (a CI run's rank 0 died of "cannot import name
        # '_get_store' from partially initialized module 'mlflow.tracking'"). And system
        # metrics that cannot start are a warning, never a stopped run.
        self.sampler = _system_sampler(self, system_metrics_s) if system_metrics_s else None
        self.shipper = Shipper(self.spool, uri)
        self.shipper.start()
        if self.sampler is not None:
            self.sampler.start()

    @property
    def run_id(self) -> Optional[str]:
        return read_run_file(self.output_dir).get("run_id")

    def _add(self, event: dict[str, Any]) -> None:
        self.spool.append(event)

    def log_params(self, params: dict[str, Any]) -> None:
        self._add({"t": "params", "p": params})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if metrics:
            self._add({"t": "metrics", "step": int(step), "ts": int(time.time() * 1000),
                       "m": {k: float(v) for k, v in metrics.items()}})

    def set_tags(self, tags: dict[str, str]) -> None:
        self._add({"t": "tags", "tags": tags})

    def log_text(self, text: str, artifact_file: str) -> None:
        self._add({"t": "text", "text": text, "file": artifact_file})

    def log_model_dir(self, path: Optional[Path], *, step: int = 0,
                      params: Optional[dict[str, Any]] = None) -> None:
        """The exported HF directory as the run's logged model (copied into MLflow's artifact
        store unless it is larger than MODEL_MAX_BYTES; its path is always a tag)."""
        if path is None:
            return
        self.set_tags({"export_dir": str(path)})
        size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
        if size > MODEL_MAX_BYTES:
            log.info("export %s (%.1f GB) is linked by its path, not copied into MLflow", path,
                     size / 1e9)
            return
        self._add({"t": "model", "dir": str(path), "name": Path(path).parent.name,
                   "step": step, "params": params or {}})

    def finish(self, status: str = "FINISHED") -> None:
        if self.sampler is not None:
            self.sampler.stop()
        self._add({"t": "status", "status": status, "ts": int(time.time() * 1000)})
        # a store that is not answering gets a short last chance, not the whole timeout
        timeout = self.flush_timeout_s if self.shipper.failures == 0 else 5.0
        if not self.shipper.stop(timeout):
            log.warning("%d bytes of tracking events could not be delivered to %s (%s); they "
                        "are kept in %s: the launcher delivers them, or run `python -m "
                        "llama_fsdp.tracking %s`", self.spool.backlog(), self.uri,
                        self.shipper.last_error, self.spool.path, self.output_dir)


def open_tracker(spec: Any) -> Any:
    """Rank 0's tracker for a RunSpec (the driver created the run), or the null twin."""
    if not spec.tracking.enabled:
        return NullTracker()
    t = spec.tracking
    return Tracker(spec.output_dir, spec.tracking_uri,
                   system_metrics_s=t.system_metrics_interval_s if t.system_metrics else None)


class NullTracker:
    """What ranks other than 0 hold: the same methods, doing nothing."""

    run_id: Optional[str] = None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_model_dir(self, path: Optional[Path], *, step: int = 0,
                      params: Optional[dict[str, Any]] = None) -> None: ...
    def finish(self, status: str = "FINISHED") -> None: ...


class Console:
    """Rank 0's progress bar and messages."""

    def __init__(self, total: int, initial: int = 0):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step",
                        dynamic_ncols=True, file=sys.stderr, mininterval=0.5)

    def set_initial(self, step: int) -> None:
        self.bar.n = self.bar.initial = step
        self.bar.refresh()

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
    def set_initial(self, step: int) -> None: ...
    def update(self, step: int, metrics: dict[str, float]) -> None: ...
    def info(self, msg: str, *args: Any) -> None: ...
    def close(self) -> None: ...


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m llama_fsdp.tracking <run dir> [--uri URI] [--timeout S]`: deliver a run's
    spooled tracking events (after an outage)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m llama_fsdp.tracking", description=main.__doc__)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--uri", default=None, help="deliver to this store instead of the run's")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not (tracking_dir(args.run_dir) / RUN_FILE).is_file():
        p.error(f"{args.run_dir} is not a run directory with tracking events (no "
                f"{tracking_dir(args.run_dir) / RUN_FILE}): give a run's directory, as the "
                "launcher's warning or the run summary names it (outputs/runs/<date>/<time>)")
    spool = Spool(args.run_dir)
    before = spool.backlog()
    left = deliver_pending(args.run_dir, deadline_s=args.timeout, uri=args.uri)
    info = read_run_file(args.run_dir)
    log.info("%s: delivered %d bytes of events to %s (run %s); %d left", args.run_dir,
             before - left, args.uri or info.get("tracking_uri"), info.get("run_id"), left)
    return 0 if left == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
