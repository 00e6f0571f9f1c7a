"""MLflow tracking off the training path, and rank 0's console.

Rank 0 appends every tracking event (params, metrics, tags, files, status: ``events.py``) to a
spool in the run directory, ``<run>/tracking/spool.jsonl`` (``spool.py``), and a background
shipper thread delivers the spool to MLflow (``delivery.py``): rank 0's, or the launcher's while
it waits on a local run (launchers/base.py), which leaves rank 0 only appending. A step never waits for MLflow:
an outage (server down, sqlite locked by parallel sweep jobs) only grows the spool; delivery
resumes when the store answers. What is left when a rank ends is delivered by the launcher,
or later with

    python -m llama_fsdp.tracking <run dir>

so nothing is lost. Delivery is at least once, in order; ``<run>/tracking/shipped`` holds how
much of the spool has been delivered. The MLflow run itself is created before launch by the
driver (prepare/tracking.py), through the same spool, so an unreachable store is reported in seconds.

Every other rank holds ``NullTracker`` and ``NullConsole`` (``tracker.py``, ``console.py``),
with the same methods doing nothing, so training code never asks which rank it is on.
"""
from . import events
from .console import Console, NullConsole
from .delivery import START_DELIVERY_S, Delivery, Shipper, close_run, deliver_pending, shipping
from .spool import Spool, read_run_file, write_run_file
from .store import FAST_FAIL_ENV, flatten, open_client, runs_page
from .tracker import NullTracker, Tracker, open_tracker

__all__ = ["Console", "Delivery", "FAST_FAIL_ENV", "NullConsole", "NullTracker",
           "START_DELIVERY_S", "Shipper", "Spool", "Tracker", "close_run", "deliver_pending",
           "events", "flatten", "open_client", "open_tracker", "read_run_file", "runs_page",
           "shipping", "write_run_file"]
