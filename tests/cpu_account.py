"""CPU-seconds per test and per scope, every process a test starts included: where `make test`'s
time goes on 2 cores, which its CPU fills (the wall time is about the CPU time / 2).

A test's wall seconds (pytest's durations, tests/scope_seconds.json) misstate what it costs the
suite: a SLURM test that waits out a grace time holds its worker but leaves the cores to the other
one, while a test that starts four ranks fills both. With ``LLAMA_FSDP_CPU_ACCOUNT=DIR`` set, each
pytest process (each xdist worker) moves itself into a cgroup (v1 ``cpuacct``) of its own before
it starts anything, so that every process it starts, and theirs (ranks, warm interpreters, a local
SLURM cluster's daemons and their job steps, servers), counts to it; the cgroup's CPU time is
read around each test (setup, call and teardown, a module's fixtures included) and written to
``DIR/<worker>.json`` at the end. ``python -m tests.cpu_account DIR`` prints the table by scope.

Needs root and a cgroup v1 cpuacct hierarchy (this project's CI machines have one); elsewhere it
says why and counts nothing. Off unless the variable is set: `make test` does not use it.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

ENV = "LLAMA_FSDP_CPU_ACCOUNT"
ROOT = Path("/sys/fs/cgroup/cpuacct")


class Account:
    """This process's cgroup and the CPU-seconds of each test run in it."""

    def __init__(self, out_dir: Path, worker: str):
        self.out_dir, self.worker = out_dir, worker
        self.group: Optional[Path] = None
        self.tests: dict[str, dict[str, float]] = {}
        self.problem: Optional[str] = None
        for stale in ROOT.glob("llama_fsdp_tests_*"):  # empty ones of ended sessions
            try:
                stale.rmdir()
            except OSError:
                pass
        try:
            group = ROOT / f"llama_fsdp_tests_{os.getpid()}"
            group.mkdir(exist_ok=True)
            (group / "cgroup.procs").write_text(str(os.getpid()))
            self.group = group
        except OSError as e:
            self.problem = f"no cpuacct cgroup ({e}): CPU time is not counted"
            print(f"{ENV}: {self.problem}", file=sys.stderr)
        self.start = self.usage()

    def usage(self) -> float:
        """CPU-seconds of every process of the cgroup so far (ended ones included)."""
        if self.group is None:
            return 0.0
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    def record(self, nodeid: str, cpu: float, wall: float) -> None:
        self.tests[nodeid] = {"cpu": round(cpu, 2), "wall": round(wall, 2)}

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        data = {"worker": self.worker, "total_cpu": round(self.usage() - self.start, 1),
                "problem": self.problem, "tests": self.tests}
        (self.out_dir / f"{self.worker}.json").write_text(json.dumps(data, indent=1))


_account: Optional[Account] = None


def configure(config) -> None:
    """From tests/conftest.py's pytest_sessionstart (in each xdist worker, before it starts
    anything): join a cgroup of this process's own when ``LLAMA_FSDP_CPU_ACCOUNT`` names a folder."""
    global _account
    out = os.environ.get(ENV)
    if not out:
        return
    worker = getattr(config, "workerinput", {}).get("workerid", "main")
    _account = Account(Path(out), worker)


def around_test(item):
    """A generator for a pytest_runtest_protocol hookwrapper: time the test's whole protocol."""
    if _account is None:
        yield
        return
    cpu, wall = _account.usage(), time.monotonic()
    yield
    _account.record(item.nodeid, _account.usage() - cpu, time.monotonic() - wall)


def finish() -> None:
    if _account is not None:
        _account.write()  # (its cgroup goes once empty: the next session removes it)


def table(directory: Path, scope_of) -> str:
    """Markdown: CPU- and wall-seconds per scope, most CPU first, over the workers' files."""
    scopes: dict[str, list[float]] = {}
    total = 0.0
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        total += data["total_cpu"]
        for nodeid, t in data["tests"].items():
            s = scopes.setdefault(scope_of(nodeid), [0.0, 0.0])
            s[0] += t["cpu"]
            s[1] += t["wall"]
    counted = sum(c for c, _ in scopes.values())
    lines = ["| scope | CPU s | wall s | CPU / wall |", "|---|---:|---:|---:|"]
    for name, (cpu, wall) in sorted(scopes.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| `{name}` | {cpu:.0f} | {wall:.0f} | {cpu / wall if wall else 0:.2f} |")
    lines.append(f"\nCPU counted in tests: {counted:,.0f} s; every worker's cgroup over its "
                 f"whole session: {total:,.0f} s.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.conftest import _scope

    print(table(Path(sys.argv[1]), _scope))
