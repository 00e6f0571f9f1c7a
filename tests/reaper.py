"""What a test process started in a session of its own (an `mlflow server`, `mlflow ui`, the warm
interpreters of tests/warm.py) ends with it, however it ends: a pytest stopped by a timeout's
SIGKILL left the docs module's `mlflow ui` and a sweep test's `mlflow server` running, adopted
by init.

``start()`` (in each pytest process, at the session's start) starts a small watcher that waits
for that process to end (a pidfd); ``register(pid)`` names a process group it then kills with
SIGKILL. At a clean end of the session the fixtures have stopped their servers and ``stop()``
tells the watcher to kill nothing. A group is killed only while it is the one registered: its
processes started no earlier than its leader did (process ids are reused).

Standard library only: the watcher runs as ``python -S -E tests/reaper.py <pid> <file>``.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

ENV = "LLAMA_FSDP_TEST_REAP_FILE"  # the watcher's file, for the processes the tests start


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot; /proc/<pid>/stat field 22)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def start(base_dir: str) -> None:
    """Start the watcher of this process."""
    path = os.path.join(base_dir, "reap.txt")
    open(path, "w").close()
    subprocess.Popen([sys.executable, "-S", "-E", os.path.abspath(__file__), str(os.getpid()),
                      path], stdin=subprocess.DEVNULL, start_new_session=True)
    os.environ[ENV] = path


def register(pgid: int) -> None:
    """Kill process group ``pgid`` if the pytest process dies before ``stop`` (from any process
    it started: the file is in the environment)."""
    path = os.environ.get(ENV)
    if path and (started := _start_time(pgid)) is not None:
        with open(path, "a") as f:
            f.write(f"{pgid} {started}\n")


def stop() -> None:
    """A clean end: the watcher kills nothing."""
    if path := os.environ.pop(ENV, None):
        with open(path, "w") as f:
            f.write("clean\n")


def _groups(path: str) -> list[tuple[int, int]]:
    try:
        lines = open(path).read().split("\n")
    except OSError:
        return []
    if "clean" in lines:
        return []
    return [(int(a), int(b)) for a, b in (ln.split() for ln in lines if ln.strip())]


def _members(pgid: int, since: int) -> list[int]:
    """The processes of group ``pgid`` started no earlier than ``since``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and int(fields[19]) >= since:
            out.append(int(name))
    return out


def watch(owner: int, path: str) -> None:
    fd = os.pidfd_open(owner)
    select.select([fd], [], [])
    for _ in range(3):  # a server may start a worker between two sweeps
        for pgid, since in _groups(path):
            for pid in _members(pgid, since):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.5)


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2])
