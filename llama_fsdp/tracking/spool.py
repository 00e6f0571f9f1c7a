"""The spool: append-only JSON lines of tracking events in the run directory
(``<run>/tracking/spool.jsonl``), how far they have been delivered (``shipped``), and the run
file (``run.json``: the store and, once created, the MLflow run id); config/rundir.py names them."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..config.metrics import GLOBAL_BATCH, SYSTEM_PREFIX
from ..config.rundir import RunDir, replace_text
from .events import Create, Event, Metrics, decode


@dataclass(frozen=True)
class RunHistory:
    """What a run's spool says its MLflow run holds: the last training step logged, and
    whether its setup (the step-0 facts, the plan) is recorded."""

    logged_through: int = 0
    started: bool = False


class Spool:
    """Append-only JSON lines in the run dir, and how far they have been delivered."""

    def __init__(self, output_dir: str | Path):
        run_dir = RunDir(output_dir)
        self.dir = run_dir.tracking
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path, self._offset_file, self._lock_file = (run_dir.spool, run_dir.shipped,
                                                         run_dir.ship_lock)
        self._lock = threading.Lock()

    def append(self, event: Event) -> None:
        line = (json.dumps(event.wire(), default=str) + "\n").encode()
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

    def pending(self, limit: int = 5000) -> list[tuple[int, Event]]:
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
                out.append((offset, decode(json.loads(raw))))
        return out

    def events(self) -> list[Event]:
        """Every event ever spooled, delivered or not (for reading a run's record)."""
        if not self.path.exists():
            return []
        return [decode(json.loads(line)) for line in self.path.read_text().splitlines()
                if line.strip()]

    def history(self) -> RunHistory:
        """The MLflow run's history as this spool wrote it (since its last Create: a new run
        in the same directory starts a new history)."""
        through, started = 0, False
        for e in self.events():
            if isinstance(e, Create):
                through, started = 0, False
            elif isinstance(e, Metrics):
                if e.step > 0 and not all(k.startswith(SYSTEM_PREFIX) for k in e.metrics):
                    through = max(through, e.step)
                started = started or (e.step == 0 and GLOBAL_BATCH in e.metrics)
        return RunHistory(through, started)

    def backlog(self) -> int:
        return max(0, (self.path.stat().st_size if self.path.exists() else 0) - self.shipped())

    @contextlib.contextmanager
    def exclusive(self, wait: bool) -> Iterator[bool]:
        """Hold the shipping lock (one deliverer at a time); yields False if busy and not wait."""
        fd = os.open(self._lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)


def read_run_file(output_dir: str | Path) -> dict[str, Any]:
    path = RunDir(output_dir).run_file
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def write_run_file(output_dir: str | Path, info: dict[str, Any]) -> None:
    path = RunDir(output_dir).run_file
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_text(path, json.dumps(info))
