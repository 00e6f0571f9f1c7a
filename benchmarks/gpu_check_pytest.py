"""pytest plugin of the GPU check's test stage (``-p benchmarks.gpu_check_pytest``): one result
per test, appended to the check's results the moment the test ends, so a stage cut in the middle
of a test still returns every test before it; a ``progress`` record when each starts.

A test's ``record_property("result", {...})`` goes into the result's ``props`` (the GPU memory
tests record their configuration, measured and predicted peak). A run on a copy broken on
purpose (``$GPU_CHECK_BROKEN``: the mutation's name) tags each result with it.
"""
from __future__ import annotations

import os
from typing import Any

import pytest

from benchmarks import gpu_report


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: Any, items: list) -> None:
    """The tests run in the order the check names them (most valuable first, for a stage cut
    short), not the suite's heaviest-scope-first order (tests/conftest.py), which follows the
    last suite run's seconds and so changes with them."""
    order = {arg: i for i, arg in enumerate(config.args)}
    items.sort(key=lambda item: order.get(item.nodeid, len(order)))


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    gpu_report.append_here({"kind": "progress", "name": nodeid})


def pytest_runtest_logreport(report: Any) -> None:
    """One result per test: its call, or the setup or teardown that did not pass."""
    if report.when == "call" or not report.passed:
        gpu_report.append_here(result(report))


def result(rep: Any) -> dict[str, Any]:
    outcome = rep.outcome if rep.when == "call" else (
        "skipped" if rep.skipped else f"error in {rep.when}")
    props = dict(rep.user_properties)
    broken = os.environ.get(gpu_report.BROKEN_ENV)  # then the test should fail
    return {"kind": "test", "name": rep.nodeid + (f" [on code broken: {broken}]" if broken else ""),
            "broken": broken, "outcome": outcome,
            "duration_s": round(rep.duration, 1), "props": props.get("result", props) or None,
            "message": None if rep.passed else message(rep),
            "command": f"python -m pytest -m gpu {rep.nodeid}"}


def message(rep: Any) -> str:
    """A skip's reason, or a failure's assertion (its ``E`` lines), short."""
    if rep.skipped and isinstance(rep.longrepr, tuple):
        return str(rep.longrepr[2]).removeprefix("Skipped: ")
    lines = [line for line in (getattr(rep, "longreprtext", "") or "").splitlines()
             if line.strip()]
    failing = [line[1:].strip() for line in lines if line.startswith("E ")]
    return (" / ".join(failing[-3:]) or (lines[-1] if lines else ""))[:600]
