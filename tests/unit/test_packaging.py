"""The install's build says nothing a user has to read: building the package (as `make run`'s
scripts/install.sh and `pip install .` do) draws no packaging warnings, and the wheel carries
every config group's files."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "llama_fsdp", "conf", "launchers", "hydra_plugins")


def _warnings(out: subprocess.CompletedProcess) -> list[str]:
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    return [line for line in log.splitlines() if "warning" in line.lower()]


def test_the_build_draws_no_packaging_warnings(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:  # the package's sources only: no build/ or egg-info of the checkout
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "--disable-pip-version-check", ".", "-w", str(tmp_path / "dist")],
                         cwd=src, capture_output=True, text=True, timeout=120)
    warnings = _warnings(out)
    assert not warnings, "the build warns:\n" + "\n".join(warnings[:20])
    names = set(zipfile.ZipFile(next((tmp_path / "dist").glob("llama_fsdp-*.whl"))).namelist())
    groups = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "conf").rglob("*.yaml"))
    missing = [g for g in groups if f"llama_fsdp/{g}" not in names]
    assert not missing, f"config files not in the wheel: {missing}"
    # hydra/sweeper=optuna's class, where Hydra instantiates sweepers from
    assert "hydra_plugins/llama_fsdp_sweeper/optuna_sweeper.py" in names
    # the editable build scripts/install.sh makes (what `make run` shows), with its filter
    quiet = re.search(r'QUIET_BUILD="([^"]+)"', (REPO / "scripts" / "install.sh").read_text())
    out = subprocess.run([sys.executable, "-c", "from setuptools import build_meta as b; "
                          "b.build_editable('editable')"], cwd=src, capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": quiet.group(1)}, timeout=120)
    warnings = _warnings(out)
    assert not warnings, "the editable build warns:\n" + "\n".join(warnings[:20])
