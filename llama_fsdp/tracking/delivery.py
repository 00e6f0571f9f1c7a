"""Delivering the spool to MLflow: in order, at least once, in batches; a transient failure
leaves the rest in the spool, a permanent one (the store refuses that event for good) skips it.

``Shipper`` is the background thread of rank 0, or of a launcher that ships while it waits
(``shipping``); ``deliver_pending`` is what the launcher (after the ranks end), the driver (a new
run's first events) and ``python -m llama_fsdp.tracking`` call.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from . import events as ev
from ..config.metrics import SYSTEM_PREFIX
from ..config.status import MLFLOW_RUNNING, MLFLOW_SCHEDULED, REQUEUED
from .mlflow_compat import delete_points_after, deletes_points
from .spool import Spool, read_run_file, write_run_file
from .store import FAST_FAIL_ENV, NotAStore, artifact_location, open_client
from .view import SHOWN, STATUS_TAG, VIEW_TAG, experiment_tags, status_text, view_is_current

log = logging.getLogger(__name__)

PERMANENT_ERRORS = ("INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "BAD_REQUEST",
                    "RESOURCE_ALREADY_EXISTS", "INVALID_STATE")
METRICS_PER_BATCH, PARAMS_PER_BATCH = 1000, 100
START_DELIVERY_S = 30.0  # how long a new run's (or sweep's) first events may take to deliver


class RunRefused(RuntimeError):
    """The store refused to create the run (a name it does not take, an experiment of that name
    deleted): nothing after the create event can be delivered, so it is not retried."""


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

    def ship(self, events: list[tuple[int, ev.Event]]) -> None:
        """Deliver events in order, marking each delivered group; raises on a transient error
        (the rest stays in the spool)."""
        i = 0
        while i < len(events):
            first = events[i][1]
            j = i + 1
            if isinstance(first, ev.Metrics):  # consecutive metric events go in batches
                n = len(first.metrics)
                while j < len(events) and isinstance(events[j][1], ev.Metrics) and \
                        n + len(events[j][1].metrics) <= METRICS_PER_BATCH:
                    n += len(events[j][1].metrics)
                    j += 1
            group = [e for _, e in events[i:j]]
            try:
                self._deliver(group)
            except Exception as e:  # noqa: BLE001 - classified: dropped or retried
                if not _permanent(e):
                    raise
                if isinstance(first, ev.Create):
                    raise RunRefused(f"MLflow refused to create the run in experiment "
                                     f"{first.experiment!r}: {str(e).splitlines()[0][:300]}") from e
                log.warning("MLflow refused a %s event (%s); it is skipped", first.KIND,
                            str(e).splitlines()[0][:300])
            self.spool.mark_shipped(events[j - 1][0])
            i = j

    def _deliver(self, group: list[ev.Event]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        c, e = self.client, group[0]
        if isinstance(e, ev.Create):
            self._create(e)
            return
        if self.run_id is None:
            raise RuntimeError("no MLflow run yet")  # transient: the create event comes first
        match e:
            case ev.Metrics():
                c.log_batch(self.run_id, metrics=[Metric(k, float(v), m.ts, m.step)
                                                  for m in group for k, v in m.metrics.items()])
            case ev.Params():
                params = [Param(k, str(v)[:6000]) for k, v in e.params.items()]
                for at in range(0, len(params), PARAMS_PER_BATCH):
                    c.log_batch(self.run_id, params=params[at:at + PARAMS_PER_BATCH])
            case ev.Tags():
                c.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in e.tags.items()])
            case ev.Text():
                c.log_text(self.run_id, e.text, e.file)
            case ev.Artifacts():
                c.log_artifacts(self.run_id, e.dir, e.path)
            case ev.Model():
                self._log_model(e)
            case ev.Inputs():
                c.log_inputs(self.run_id, datasets=[_dataset_input(d) for d in e.datasets])
            case ev.Status():
                c.set_tag(self.run_id, STATUS_TAG, e.word or status_text(e.status))
                c.set_terminated(self.run_id, status=e.status, end_time=e.ts)
            case ev.Running():
                c.update_run(self.run_id, status=MLFLOW_RUNNING)
                c.set_tag(self.run_id, STATUS_TAG, status_text(MLFLOW_RUNNING))
            case ev.Waiting():
                c.update_run(self.run_id, status=MLFLOW_SCHEDULED)
                c.set_tag(self.run_id, STATUS_TAG, REQUEUED)
            case ev.Rewind():
                self._rewind(e.step)

    def _rewind(self, step: int) -> None:
        """The stopped attempt's points past ``step`` out of the run's history, where the store
        allows it (the resumed attempt logs the steps again after this event); elsewhere the
        resumed attempt did not log them again (tracker.py)."""
        if not deletes_points(self.uri):
            return
        try:
            gone = delete_points_after(self.client, self.run_id, step, keep_prefix=SYSTEM_PREFIX)
        except Exception as e:  # noqa: BLE001 - never a reason to hold the rest of the spool
            log.warning("the points logged after step %d by the attempt that stopped could not "
                        "be replaced (%s: %s): those steps show twice in MLflow", step,
                        type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
            return
        log.info("the run continues from step %d: %d metric points logged after it by the "
                 "attempt that stopped are replaced", step, gone)

    def _log_model(self, e: ev.Model) -> None:
        """An exported directory as the run's logged model (its Models column and tab):
        downloadable and registrable from the UI. The run's final metrics are logged to the run;
        the rounded ones the runs table shows (view.SHOWN) are linked to the model too, so its
        page lists ``tokens per sec 7317``, not the exact 7317.475065965187."""
        from mlflow.entities import LoggedModelOutput, Metric

        c = self.client
        exp_id = c.get_run(self.run_id).info.experiment_id
        model = c.create_logged_model(exp_id, name=e.name, source_run_id=self.run_id,
                                      model_type=e.model_type,
                                      params={k: str(v) for k, v in e.params.items()})
        c.log_model_artifacts(model.model_id, e.dir)
        c.finalize_logged_model(model.model_id, "READY")
        c.log_outputs(self.run_id, [LoggedModelOutput(model.model_id, e.step)])
        if e.metrics:
            ts = e.ts or ev.now_ms()
            shown = {s.name for s in SHOWN}
            c.log_batch(self.run_id, metrics=[
                Metric(k, float(v), ts, 0, model_id=model.model_id if k in shown else None)
                for k, v in e.metrics.items()])

    def _create(self, e: ev.Create) -> None:
        """The run (and its experiment) for a spool that starts without one."""
        if self.run_id is not None:
            return
        c = self.client
        exp = c.get_experiment_by_name(e.experiment)
        exp_id = exp.experiment_id if exp else c.create_experiment(
            e.experiment, artifact_location=artifact_location(self.uri, e.experiment))
        view = exp.tags.get(VIEW_TAG) if exp else None
        if view is None:
            for key, value in experiment_tags().items():
                c.set_experiment_tag(exp_id, key, value)
        elif not view_is_current(view):  # an earlier version's view: this one replaces it
            c.set_experiment_tag(exp_id, VIEW_TAG, experiment_tags(view)[VIEW_TAG])
        for key, value in e.experiment_tags.items():
            c.set_experiment_tag(exp_id, key, value)
        run = c.create_run(exp_id, run_name=e.run_name, tags=e.tags, start_time=e.ts)
        self.run_id = run.info.run_id
        where = self.spool.dir.parent
        write_run_file(where, {**read_run_file(where), "run_id": self.run_id,
                               "experiment_id": exp_id, "tracking_uri": self.uri})


def _dataset_input(d: dict[str, Any]) -> Any:
    from mlflow.entities import Dataset, DatasetInput, InputTag

    ds = Dataset(name=d["name"], digest=d["digest"], source_type=d["source_type"],
                 source=d["source"], schema=d.get("schema"), profile=d.get("profile"))
    return DatasetInput(ds, tags=[InputTag("mlflow.data.context", d.get("context", "train"))])


def close_run(output_dir: str | Path, status: str, *, deadline_s: float) -> int:
    """End the run's MLflow record with ``status`` (FAILED, KILLED) after what is spooled, and
    deliver; returns the undelivered bytes."""
    Spool(output_dir).append(ev.Status(status))
    return deliver_pending(output_dir, deadline_s=deadline_s)


def deliver_pending(output_dir: str | Path, *, deadline_s: float, uri: Optional[str] = None,
                    wait_for_lock: bool = True, patience_s: float = 10.0,
                    refused: str = "warn") -> int:
    """Deliver what the spool holds until it is empty, the deadline passes, or the store has
    failed for ``patience_s`` without a success; returns the undelivered bytes (0: everything
    is in MLflow). A store that refuses the run itself (RunRefused, NotAStore) ends the
    delivery: ``refused="raise"`` raises it, else it is logged once."""
    spool = Spool(output_dir)
    uri = uri or read_run_file(output_dir).get("tracking_uri")
    if uri is None:
        return spool.backlog()
    end, delay = time.monotonic() + deadline_s, 0.5
    with spool.exclusive(wait_for_lock) as mine:
        if not mine:
            return spool.backlog()
        delivery, failing_since = None, None
        while (pending := spool.pending()) and time.monotonic() < end:
            try:
                # opening a sqlite store migrates it: parallel first opens can collide
                delivery = delivery or Delivery(spool, uri)
                delivery.ship(pending)
                delay, failing_since = 0.5, None
            except (RunRefused, NotAStore) as e:  # the same every time: no retry
                if refused == "raise":
                    raise
                log.warning("%s", e)
                break
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
                    while pending := self.spool.pending():
                        delivery.ship(pending)
                    delay, self.failures = self.interval_s, 0
                except Exception as e:  # noqa: BLE001 - transient: back off, keep the spool
                    self.failures += 1
                    self.last_error = str(e).splitlines()[0][:300] if str(e) else repr(e)
                    if self.failures == 1:
                        log.warning("MLflow at %s is not answering (%s); training goes on and "
                                    "the metrics wait in %s", self.uri, self.last_error,
                                    self.spool.path)
                    delay = min(self.interval_s * 2 ** self.failures, 30.0)

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


@contextlib.contextmanager
def shipping(output_dir: str | Path, uri: str, *, final_s: float) -> Iterator[Shipper]:
    """The spool delivered by a ``Shipper`` of this process while the block runs; at its end, up
    to ``final_s`` for what is left (none while the store is failing: the caller's last
    delivery has its own deadline)."""
    shipper = Shipper(Spool(output_dir), uri)
    shipper.start()
    try:
        yield shipper
    finally:
        shipper.stop(final_s if shipper.failures == 0 else 0.0)
