"""What rank 0 holds: ``Tracker`` (each call appends an event to the spool; the shipper thread
delivers), with ``NullTracker``, its do-nothing twin, on every other rank."""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Optional

from ..config.metrics import SYSTEM_PREFIX
from ..config.status import MLFLOW_FINISHED
from . import events as ev
from .delivery import Shipper
from .mlflow_compat import deletes_points
from .spool import RunHistory, Spool, read_run_file

log = logging.getLogger(__name__)

MODEL_MAX_BYTES = 20 * 10**9  # larger exports are linked by path, not copied into MLflow


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
        """Samples are held until the run logs its first measured metric (or ends): MLflow's
        compare page plots a run's first metric by default, and a sampler that starts before
        the first step would make that ``system/cpu_utilization_percentage``, not the loss."""
        sample, halted, held = 0, False, []
        while not halted:  # every interval, and once more at the end (a run shorter than one
            halted = self._halt.wait(self.interval_s)  # interval still has its sample)
            metrics: dict[str, float] = {}
            for m in self.monitors:
                try:
                    m.collect_metrics()
                    metrics.update(m.aggregate_metrics())
                finally:
                    m.clear_metrics()
            held.append(({SYSTEM_PREFIX + k: v for k, v in metrics.items()}, sample))
            sample += 1
            if halted or self.tracker.measured.is_set():
                for values, step in held:
                    self.tracker.log_metrics(values, step=step)
                held.clear()

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
                 system_metrics_s: Optional[float] = None, ship: bool = True,
                 logged_as: Optional[dict[str, str]] = None):
        """``ship=False``: only append; the launcher delivers the spool while it waits (it
        then never loads MLflow here, unless for system metrics). ``logged_as``: the names
        MLflow gets for some metrics (the objective's: DPO's loss is ``dpo_loss``)."""
        self.output_dir, self.uri = output_dir, uri
        self.logged_as = dict(logged_as or {})
        self.spool = Spool(output_dir)
        self.flush_timeout_s = flush_timeout_s
        # The sampler's MLflow monitors are imported before the shipper thread starts and
        # imports MLflow for its client: two threads importing the mlflow package at once can
        # get it partially initialized ("cannot import name '_get_store' from partially
        # initialized module 'mlflow.tracking'"). System metrics that cannot start are a
        # warning, never a stopped run.
        self.sampler = _system_sampler(self, system_metrics_s) if system_metrics_s else None
        self._start_metrics: dict[str, float] = {}
        self._start_lock = threading.Lock()  # the system sampler logs from its own thread
        self._held_through = 0  # steps 1..this are in the run's history already (not logged)
        self.measured = threading.Event()  # a metric other than system/* has been logged
        self.shipper = Shipper(self.spool, uri) if ship else None
        if self.shipper is not None:
            self.shipper.start()
        if self.sampler is not None:
            self.sampler.start()

    @property
    def run_id(self) -> Optional[str]:
        return read_run_file(self.output_dir).get("run_id")

    def log_params(self, params: dict[str, Any]) -> None:
        self.spool.append(ev.Params(params))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if 0 < step <= self._held_through:  # kept from the attempt before (continue_from)
            metrics = {k: v for k, v in metrics.items() if k.startswith(SYSTEM_PREFIX)}
        if metrics:
            self.spool.append(ev.Metrics({self.logged_as.get(k, k): float(v)
                                          for k, v in metrics.items()}, int(step)))
        if any(not k.startswith(SYSTEM_PREFIX) for k in metrics):
            self.measured.set()  # after the append: the sampler's held samples go after it
        self._log_start_metrics()

    def history(self) -> RunHistory:
        """What this run's MLflow record holds already (a run continued from a checkpoint)."""
        return self.spool.history()

    def continue_from(self, step: int, history: RunHistory) -> None:
        """The run goes on from its checkpoint at ``step``, after attempts that logged up to
        ``history.logged_through``: the steps between are trained again and must show once,
        the new attempt's. A store that can delete metric points drops the stopped attempt's
        (a Rewind event, delivered before the new points); an MLflow server cannot, and the
        new attempt does not log the steps the history holds (each step once, the earlier
        attempt's: the same batches from the same state)."""
        if history.logged_through <= step:
            return
        if deletes_points(self.uri):
            self.spool.append(ev.Rewind(step))
            return
        self._held_through = history.logged_through
        log.info("steps %d-%d are in the run's history already (logged before it stopped; %s "
                 "cannot delete metric points): they are trained again, not logged again",
                 step + 1, history.logged_through, self.uri)

    def running(self) -> None:
        """The run is RUNNING again (its job requeued, or its ranks restarted)."""
        self.spool.append(ev.Running())

    def log_start_metrics(self, metrics: dict[str, float]) -> None:
        """Step-0 facts of the run (the plan, the data, the parameter counts), logged after the
        first measured metrics (or when the run ends before any): MLflow's compare page plots a
        run's first metric by default, and it should be a measured one, not the plan's."""
        with self._start_lock:
            self._start_metrics.update({k: float(v) for k, v in metrics.items()})

    def _log_start_metrics(self) -> None:
        with self._start_lock:
            held, self._start_metrics = self._start_metrics, {}
        if held:
            self.spool.append(ev.Metrics(held, 0))

    def set_tags(self, tags: dict[str, str]) -> None:
        self.spool.append(ev.Tags(tags))

    def log_text(self, text: str, artifact_file: str) -> None:
        self.spool.append(ev.Text(text, artifact_file))

    def log_model_dir(self, path: Optional[Path], *, name: str, step: int = 0,
                      params: Optional[dict[str, Any]] = None,
                      model_type: str = "transformers-llama",
                      metrics: Optional[dict[str, float]] = None) -> bool:
        """An exported directory as the run's logged model ``name`` (copied into MLflow's
        artifact store unless it is larger than MODEL_MAX_BYTES; its path is always a tag),
        with the run's final ``metrics`` linked to it. False: no model was logged, and the
        metrics are the caller's to log."""
        if path is None:
            return False
        self.set_tags({"export_dir": str(path)})
        size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
        if size > MODEL_MAX_BYTES:
            log.info("export %s (%.1f GB) is linked by its path, not copied into MLflow", path,
                     size / 1e9)
            return False
        self._log_start_metrics()
        self.spool.append(ev.Model(str(path), name, step, params or {}, model_type,
                                   {self.logged_as.get(k, k): float(v)
                                    for k, v in (metrics or {}).items()}, ev.now_ms()))
        return True

    def finish(self, status: str = MLFLOW_FINISHED, word: Optional[str] = None) -> None:
        if self.sampler is not None:
            self.sampler.stop()
        self._log_start_metrics()
        self.spool.append(ev.Status(status, word=word))
        if self.shipper is None:
            return
        # a store that is not answering gets a short last chance, not the whole timeout
        timeout = self.flush_timeout_s if self.shipper.failures == 0 else 5.0
        if not self.shipper.stop(timeout):
            log.warning("%d bytes of tracking events could not be delivered to %s (%s); they "
                        "are kept in %s: the launcher delivers them, or run `python -m "
                        "llama_fsdp.tracking %s`", self.spool.backlog(), self.uri,
                        self.shipper.last_error, self.spool.path, self.output_dir)


class NullTracker:
    """What ranks other than 0 hold: the same methods, doing nothing."""

    run_id: Optional[str] = None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def history(self) -> RunHistory:
        return RunHistory()
    def continue_from(self, step: int, history: RunHistory) -> None: ...
    def running(self) -> None: ...
    def log_start_metrics(self, metrics: dict[str, float]) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_model_dir(self, path: Optional[Path], *, name: str, step: int = 0,
                      params: Optional[dict[str, Any]] = None,
                      model_type: str = "transformers-llama",
                      metrics: Optional[dict[str, float]] = None) -> bool:
        return False
    def finish(self, status: str = MLFLOW_FINISHED, word: Optional[str] = None) -> None: ...


def open_tracker(spec: Any) -> Any:
    """Rank 0's tracker for a RunSpec (the driver created the run), or the null twin."""
    if not spec.tracking.enabled:
        return NullTracker()
    from ..config.objectives import OBJECTIVES

    t = spec.tracking
    return Tracker(spec.output_dir, spec.tracking_uri, ship=not spec.launcher_ships,
                   system_metrics_s=t.system_metrics_interval_s if t.system_metrics else None,
                   logged_as=OBJECTIVES[spec.objective.name].logged_as)
