"""Local ranks forked from an interpreter that has imported their modules once.

A rank's process spends about 3.5 s of CPU importing torch, transformers and llama_fsdp before
it does anything (benchmarks/cpu_runtime.md), and a local run of n ranks paid that n times.
Here the local controller (launchers/controller.py) imports the entry point's module once,
then forks each rank supervisor instead of starting a new interpreter, and each supervisor
forks its worker (launchers/rank.py): a run of n ranks imports once. The process tree is the
one the launcher always had (controller -> supervisor -> worker, each the parent of the next),
so a worker still dies with its supervisor, a supervisor's exit code and signal are still
read by waitpid, and the reports are the same.

A fork is made the way a new interpreter would start: the signal handlers that Python code
installed go back to their defaults, the standard streams are the task's log files written
through (``python -u``), the task's environment is set, and the process ends with
``os._exit`` after its atexit handlers, never returning into the code that forked it.
Forking is safe here because the forking processes have only imported modules: no parallel
region ran and no process group exists before the fork. The imports leave a few idle native
threads (three with torch 2.13 and transformers 5.24, one of them pyarrow's jemalloc background
thread); glibc's and jemalloc's fork handlers keep the allocators usable in the child, and
Python 3.12's warning about forking a process with threads is silenced for these forks alone.
The local launcher asks for it on the CPU only: a CUDA rank starts as a new interpreter, since
CUDA cannot be used in a child forked from a process that initialized its driver, which an
import may do, and a GPU run's start-up is small next to its work.

SLURM's supervisors are started by srun on each node, and torchrun's by torchrun, so they start
their workers as new interpreters, as before (``preloaded`` is false there).
"""
from __future__ import annotations

import importlib
import io
import os
import signal
import sys
import traceback
import warnings
from typing import Any, Callable, Mapping, Optional

from .process import exit_now

PRELOAD_ENV = "LLAMA_FSDP_PRELOAD"  # the entry point's module, set by the local launcher
_preloaded = False


def preload() -> bool:
    """Import the module $LLAMA_FSDP_PRELOAD names (the local controller); whether there was
    one."""
    global _preloaded
    module = os.environ.get(PRELOAD_ENV)
    if module:
        importlib.import_module(module)
        _preloaded = True
    return bool(module)


def preloaded() -> bool:
    """Whether this process was forked from one that preloaded the ranks' modules (its own
    children are then forked too)."""
    return _preloaded


class Forked:
    """A forked child, with what the controller and the supervisor use of subprocess.Popen."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        while self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a pid that was reaped (and may be reused)
            os.kill(self.pid, sig)


def fork(run: Callable[[], Any], *, stdout: Optional[int] = None, stderr: Optional[int] = None,
         env: Optional[Mapping[str, str]] = None,
         before: Callable[[], None] = lambda: None) -> Forked:
    """Run ``run()`` in a forked child set up as a new interpreter would be (the module
    docstring); its return value is the exit code, as ``sys.exit`` takes it. ``stdout`` /
    ``stderr``: file descriptors to become the child's 1 and 2; ``before``: called in the child
    once they are, before ``run`` (as Popen's preexec_fn)."""
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
        _flush(stream)
    with warnings.catch_warnings():  # Python >= 3.12 on the imports' threads (module docstring)
        warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks",
                                category=DeprecationWarning)
        pid = os.fork()
    if pid:
        return Forked(pid)
    code: Any = 1
    try:
        _as_new_process(stdout, stderr, env)
        before()
        code = run()
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends an interpreter
        traceback.print_exc()
    _end(code)


def _as_new_process(stdout: Optional[int], stderr: Optional[int],
                    env: Optional[Mapping[str, str]]) -> None:
    for sig in signal.valid_signals():
        handler = signal.getsignal(sig)
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_DFL)
    for fd, target in ((1, stdout), (2, stderr)):
        if target is not None and target != fd:
            os.dup2(target, fd)
    sys.stdout = _unbuffered(1, sys.stdout)
    sys.stderr = _unbuffered(2, sys.stderr)
    if env:
        os.environ.update(env)


def _unbuffered(fd: int, old: Any) -> io.TextIOWrapper:
    """A text stream on ``fd`` as ``python -u`` makes it (written through at once)."""
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False),
                            encoding=getattr(old, "encoding", None) or "utf-8",
                            errors=getattr(old, "errors", None) or "backslashreplace",
                            write_through=True)


def _end(code: Any) -> None:
    """As a program ends here: exit_now (threads, atexit handlers, streams, os._exit)."""
    try:
        exit_now(code if isinstance(code, (int, str)) or code is None else 1)
    finally:
        os._exit(1)  # exit_now itself failed


def _flush(stream: Any) -> None:
    try:
        stream.flush()
    except (OSError, ValueError, AttributeError):
        pass
