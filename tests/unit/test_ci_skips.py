"""What keeps CI from weakening quietly: a skip CI does not allow fails it (tests/conftest.py),
the floor run's skips of another torch are allowed there only, and scripts/install.sh says
loudly when it installs another torch than the one README.md's numbers are of."""
from __future__ import annotations

import subprocess

import pytest
from _pytest.reports import TestReport

from tests import conftest

# tests/integration/test_local_run.py's skip on a torch other than the README's
README_SKIP = "the README's numbers are of torch 2.13.0+cpu; this is 2.14.0+cpu"


def _skipped(reason: str) -> TestReport:
    return TestReport("tests/t.py::test_t", ("tests/t.py", 1, "test_t"), {}, "skipped",
                      ("tests/t.py", 1, f"Skipped: {reason}"), "call")


@pytest.mark.parametrize("env,outcome", [
    ({}, "skipped"),  # not CI: a skip is a skip
    ({conftest.CI_ENV: "1"}, "failed"),  # CI's main run: the install fell back, say so
    ({conftest.CI_ENV: "1", conftest.FLOOR_ENV: "1"}, "skipped"),  # the floor run's torch 2.11
])
def test_another_torch_than_the_readme_s_may_skip_in_the_floor_run_only(monkeypatch, env,
                                                                         outcome):
    for name in (conftest.CI_ENV, conftest.FLOOR_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    report = _skipped(README_SKIP)
    conftest._fail_unexpected_skip(report)
    assert report.outcome == outcome, report.longrepr
    other = _skipped("some test's reason")  # a reason no list allows fails CI, floor or not
    conftest._fail_unexpected_skip(other)
    assert other.outcome == ("skipped" if not env else "failed")


# scripts/install.sh's python, pip and nvidia-smi, as a machine without a GPU and without the
# pinned torch wheel has them: every call is logged; the pinned install fails unless HAVE_PIN=1
PYTHON_STUB = """#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
case "$*" in
  "-c import torch") exit 1 ;;
  *"install -q torch=="*"+cpu"*) [ "${HAVE_PIN:-0}" = 1 ] ;;
  "-c import torch; print(torch.__version__)") echo 2.99.0+cpu ;;
  *) exit 0 ;;
esac
"""


def _install(tmp_path, have_pin: bool) -> tuple[subprocess.CompletedProcess, str]:
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    for path, text in ((venv / "bin" / "python", PYTHON_STUB),
                       (bin_dir / "nvidia-smi", "#!/bin/sh\nexit 1\n")):
        path.write_text(text)
        path.chmod(0o755)
    log = tmp_path / "calls.log"
    r = subprocess.run(["bash", str(conftest.REPO / "scripts" / "install.sh")],
                       env={"PATH": f"{bin_dir}:/usr/bin:/bin", "VENV": str(venv),
                            "TORCH_VERSION": "9.9.9", "STUB_LOG": str(log),
                            "HAVE_PIN": "1" if have_pin else "0"},
                       capture_output=True, text=True, timeout=60)
    return r, log.read_text()


def test_the_install_says_loudly_when_it_falls_back_to_another_torch(tmp_path):
    r, calls = _install(tmp_path / "missing", have_pin=False)
    assert r.returncode == 0, r.stderr
    assert "install -q torch --index-url https://download.pytorch.org/whl/cpu" in calls
    assert ("WARNING: torch 9.9.9+cpu could not be installed; installed the newest CPU\n"
            "torch instead: 2.99.0+cpu.") in r.stderr, r.stderr
    assert "test_local_run.py skips that check (under LLAMA_FSDP_CI=1 it fails)" in r.stderr
    # positive control: the pinned wheel is there, nothing else is installed, nothing said
    r, calls = _install(tmp_path / "pinned", have_pin=True)
    assert r.returncode == 0, r.stderr
    assert "install -q torch==9.9.9+cpu" in calls and "--index-url" not in calls
    assert "WARNING" not in r.stdout + r.stderr
