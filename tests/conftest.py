"""Shared fixtures: the real composed config (conf/) turned into RunSpecs for tests."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Rank processes import test hooks (tests.faults.hooks, through train.callbacks).
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])
# CPU tests pin the CPU, so they mean the same on a machine with a GPU.
CPU = ["cluster.device=cpu"]


def compose(overrides: list[str] | None = None):
    """Compose conf/ exactly as `python -m llama_fsdp` does, with test overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from llama_fsdp.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides or []))


def make_spec(overrides: list[str] | None = None, *, output_dir: str | Path = "/tmp/llama_fsdp_test"):
    """A RunSpec of the real composed config; on the CPU unless an override says otherwise."""
    from llama_fsdp.spec import build_spec

    cfg = compose([f"output_dir={output_dir}", *CPU, *(overrides or [])])
    return build_spec(cfg, launch_dir=REPO)


def launch_prepared(spec, *, command: str = "pytest"):
    """What `python -m llama_fsdp` does after planning: prepare in this process, then launch
    the real rank processes; returns the ranks' results."""
    from llama_fsdp.launchers import launch
    from llama_fsdp.prepare import prepare

    prepared = prepare(spec, command=command)
    return launch(prepared.spec, "llama_fsdp.worker:run_worker", stream=False)


@pytest.fixture
def spec_factory(tmp_path):
    """make_spec with a fresh output dir and a private MLflow store per test."""

    def factory(overrides: list[str] | None = None, **kw):
        out = kw.pop("output_dir", tmp_path / "run")
        base = [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
        return make_spec([*base, *(overrides or [])], output_dir=out)

    return factory


def mask_runs(mask) -> list[tuple[int, int]]:
    """[start, end) of each run of true values in a 0/1 mask."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test` runs `-n 2 --dist loadgroup`): a module's tests stay on
    one worker, and every test on the session's SLURM cluster shares one worker (one cluster, not
    one per worker). A worker may still run another module's tests between them, which tears
    module-scoped fixtures down: the expensive shared runs in tests/multirank, integration and
    faults are session-scoped so that they run once (measured: four of them ran twice, 70-117 s
    each)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        slurm = "slurm_cluster" in getattr(item, "fixturenames", ())
        item.add_marker(pytest.mark.xdist_group("slurm" if slurm else item.module.__name__))
