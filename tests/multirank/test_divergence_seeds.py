"""The divergence guard never flags the default run: `python -m llama_fsdp` on 2 gloo ranks (60
steps, the tiny recipe) at train.seed=2, the seed with the largest spike of seeds 0-4 (a loss 2.08
above the lowest so far; all five measured in docs/recipes.md), finishing with a loss that never
comes near the guard's line, nor that of a guard 10% tighter. Seed 0 is the default command's,
which every test of the default run runs (a flagged run exits 3)."""
from __future__ import annotations

import pytest

from llama_fsdp.config.schema import DivergenceConfig
from llama_fsdp.train.divergence import DivergenceGuard
from tests.conftest import make_spec
from tests.distributed import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SEEDS = (2,)  # seeds 0-4 cost 230 s of the suite on CI; the others never came close


def _train(rank, world, specs):
    import torch

    from llama_fsdp.train.worker import DistEnv, RankRun

    env, out = DistEnv(rank, rank, world, world), {}
    for seed, spec in specs.items():
        out[seed] = RankRun.build(spec, env, torch.device("cpu")).train()
    return out


def test_the_default_run_is_never_flagged_at_its_spikiest_seed(tmp_path):
    # the default command's run (eval off: the guard reads the training loss only)
    specs = {seed: make_spec([f"train.seed={seed}", "tracking.enabled=false",
                              "eval.every_steps=0", "eval.task_prompts=0",
                              "save.export_hf=false"],
                             output_dir=tmp_path / f"seed{seed}") for seed in SEEDS}
    assert all(s.train.divergence == DivergenceConfig() for s in specs.values())
    results = run_ranks(_train, 2, specs, timeout=900)[0]
    # with room to spare: a guard 10% tighter in ratio and half the rise passes them too
    tighter = DivergenceConfig(ratio=1.35, min_rise=0.5)
    for seed, r in results.items():
        assert r.status == "finished" and r.steps == 60 and r.report is None, (seed, r.status)
        guard = DivergenceGuard(tighter)
        for step, loss in enumerate(r.losses, 1):
            guard.observe(step, loss)  # (raises Diverged)
        assert r.losses[-1] < r.losses[0] / 3, (seed, r.losses[0], r.losses[-1])
