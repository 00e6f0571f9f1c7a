"""What a launched program does first and last: find its entry point (``load_entry``), and end
without the interpreter's finalization once its work is done and reported (``exit_now``: the
ranks' worker, the driver, a forked supervisor: launchers/forked.py)."""
from __future__ import annotations

import atexit
import gc
import importlib
import os
import sys
import threading
from typing import Any, Callable, NoReturn, Union

Entry = Union[Callable[[Any], Any], str]  # a module-level function, or "module:attr"


def exit_now(code: Union[int, str, None]) -> NoReturn:
    """End a process whose work is done and reported without the interpreter's finalization.
    What finalization does first still runs: thread pools are shut down and non-daemon threads
    joined, then the atexit handlers (logging's flush among them); the standard streams are
    flushed; then ``os._exit``. ``code`` is what ``sys.exit`` takes (a string is printed, exit 1).

    Finalization can only lose here. A C++ thread that comes back into Python while the
    interpreter finalizes (a gloo worker dropping a work's tensors, a store wait timing out) is
    ended by CPython with a forced unwind that C++ turns into std::terminate: "terminate called
    without an active exception", SIGABRT, and a rank that finished is reported killed
    (pytorch/pytorch#179291; tests/unit/test_launchers.py makes it happen). Module teardown of
    what torch, transformers and mlflow loaded goes with it."""
    if isinstance(code, str):
        sys.stderr.write(code + "\n")
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # finalization's first step
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader went away
            pass
    os._exit(code or 0)


def load_entry(entry: Entry) -> Callable[[Any], Any]:
    """The function a "module:attr" entry point names (a function passes through)."""
    if not isinstance(entry, str):
        return entry
    module, _, attr = entry.partition(":")
    return getattr(importlib.import_module(module), attr)


def skip_final_collection() -> None:
    """Call last in a process that imported torch, transformers and mlflow: moves every object
    to the permanent generation, so the interpreter's collections at exit skip the ~500k
    objects those imports leave, which every rank and the launcher paid after the run had
    finished (benchmarks/cpu_runtime.md). atexit handlers, buffered files and module teardown
    still run; only cyclic garbage left at exit goes to the OS uncollected."""
    gc.freeze()

