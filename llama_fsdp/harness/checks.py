"""What the finished-run commands (evaluate, generate) check before the work starts, and how they
end: where the results go, the options' bounds, a task's local data files; SIGTERM / SIGHUP
unwind like an error (the converted model's temporary folder is removed), a reader that goes away
(``| head -1``) ends the command quietly. Each problem is one line naming it and the fix."""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

log = logging.getLogger("llama_fsdp.harness")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


# --- where the results go -----------------------------------------------------------------------


def output_problem(path: Path, what: str, fix: str) -> Optional[str]:
    """Why the results JSON cannot be written at ``path`` (``what`` names it in the message), or
    None: it is not there yet, and its nearest existing folder takes a new file (tried with a
    file made and removed, so a read-only mount or a folder of someone else's is found now, not
    after the scoring)."""
    if path.is_dir():
        return f"{what} {path} is a folder: give a file name ({path / 'results.json'})"
    if path.exists() or path.is_symlink():
        return (f"{what} {path} exists: evaluate never writes over a file; {fix}")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{what} {path}: {folder} is a file, not a folder; {fix}"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".llama_fsdp-probe-"):
            pass
    except OSError as e:
        return f"{what} {path}: {folder} takes no new file ({e.strerror or e}); {fix}"
    return None


# --- options ------------------------------------------------------------------------------------


def finite_problem(flag: str, value: Optional[float], *, low: float, low_open: bool) -> \
        Optional[str]:
    """``flag`` must be a finite number above ``low`` (or at least ``low``), or not given."""
    if value is None:
        return None
    bound = f"> {low:g}" if low_open else f">= {low:g}"
    if not math.isfinite(value) or (value <= low if low_open else value < low):
        return f"{flag} {value} must be a finite number {bound}"
    return None


def context_of(hf_dir: Path) -> Optional[int]:
    """The model's context in tokens (config.json's max_position_embeddings), when it says."""
    from ..config.hf_dir import read_config_json

    n = read_config_json(hf_dir).get("max_position_embeddings")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


# --- a task's local data files ------------------------------------------------------------------


def _files(data_files: Any) -> list[str]:
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, (list, tuple)):
        return [f for x in data_files for f in _files(x)]
    if isinstance(data_files, dict):
        return [f for x in data_files.values() for f in _files(x)]
    return []


def _leaf_configs(tm: Any, name: str, seen: set[str]) -> Iterator[tuple[str, dict]]:
    """(task, its YAML with includes merged) of the leaf tasks under ``name``: the harness
    package's walk of lm-eval's index, read without running the tasks' code."""
    from . import _leaf_entries, _task_config

    for task, entry in _leaf_entries(tm, name, seen):
        yield task, _task_config(entry)


def task_data_problems(tm: Any, names: list[str]) -> list[str]:
    """Each local data file a task reads (``dataset_kwargs.data_files`` of a ``dataset_path:
    json|csv|...`` task): it exists, is text, and a JSON file parses, line by line for JSON
    lines, before any weights are read."""
    from ..data.sources import _diagnose_load_error, _not_text, _too_deep

    out: list[str] = []
    for name in names:
        for task, cfg in _leaf_configs(tm, name, set()):
            kwargs = cfg.get("dataset_kwargs") or {}
            files = _files(kwargs.get("data_files")) if isinstance(kwargs, dict) else []
            for f in files:
                p = Path(f).expanduser()
                if not p.is_file():
                    out.append(f"task {task}: its data file {f} (dataset_kwargs.data_files) "
                               f"{'is a folder' if p.is_dir() else 'does not exist'}: fix the "
                               "path in its YAML")
                    continue
                if p.suffix.lower() not in (".json", ".jsonl"):
                    continue
                bad = _not_text(str(p)) or _too_deep(str(p))
                if bad is None:
                    with contextlib.suppress(ValueError):
                        text = p.read_text(encoding="utf-8")
                        try:
                            json.loads(text)
                        except json.JSONDecodeError:
                            if any(_bad_line(line) for line in text.splitlines()):
                                bad = str(_diagnose_load_error(str(p), ValueError("not JSON")))
                if bad:
                    out.append(f"task {task}: {bad}")
    return out


def _bad_line(line: str) -> bool:
    if not line.strip():
        return False
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return True
    return False


# --- how a command ends -------------------------------------------------------------------------


class Stopped(Exception):
    """SIGTERM or SIGHUP arrived: raised where the command was, so every ``with`` unwinds."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, _frame: Any) -> None:
    for s in STOP_SIGNALS:  # a second signal does not cut the cleanup short
        signal.signal(s, signal.SIG_IGN)
    raise Stopped(signum)


def run_command(body: Callable[[Optional[list[str]]], int], argv: Optional[list[str]]) -> int:
    """``body(argv)``'s exit code; SIGTERM / SIGHUP: the temporary folders removed, one line,
    128 + the signal; Ctrl-C: one line, 130; a closed pipe on standard output: quiet, 141 (as
    SIGPIPE ends ``yes``)."""
    old = {s: signal.signal(s, _raise_stopped) for s in STOP_SIGNALS}
    try:
        return body(argv)
    except Stopped as e:
        log.error("stopped by %s: nothing more was done, and the temporary model folder is "
                  "removed", e)
        return 128 + e.signum
    except KeyboardInterrupt:
        log.error("stopped by Ctrl-C")
        return 130
    except BrokenPipeError:
        with contextlib.suppress(OSError, ValueError):  # nothing more reaches the reader
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    finally:
        for s, h in old.items():
            signal.signal(s, h)
