"""Shared fixtures: the real composed config (conf/) turned into RunSpecs for tests."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
    from llama_fsdp.spec import build_spec

    cfg = compose([f"output_dir={output_dir}", *(overrides or [])])
    return build_spec(cfg, launch_dir=REPO)


@pytest.fixture
def spec_factory(tmp_path):
    """make_spec with a fresh output dir and a private MLflow store per test."""

    def factory(overrides: list[str] | None = None, **kw):
        out = kw.pop("output_dir", tmp_path / "run")
        base = [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
        return make_spec([*base, *(overrides or [])], output_dir=out)

    return factory
