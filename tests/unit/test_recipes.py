"""The recipe table: which values a run takes for its size, method and objective, that a value
the user gives wins (and is said so), how a short run's warm-up is shortened, and what the
plan prints (docs/recipes.md)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from llama_fsdp.config import recipes
from tests.conftest import REPO, make_spec

OPTIM = ("train.lr", "train.warmup_steps", "train.min_lr_ratio", "train.weight_decay",
         "train.beta1", "train.beta2", "train.eps", "train.max_grad_norm")


def _values(spec, keys=OPTIM):
    return tuple(spec.recipe.values[k] for k in keys)


@pytest.mark.parametrize("size", ["1b", "3b", "8b", "70b", "405b"])
def test_each_size_takes_torchtune_trl_values_for_its_method_and_objective(size):
    long = "train.max_steps=2000"  # (no warm-up shortened)
    full = make_spec([f"model={size}", long])
    assert full.recipe.name == f"{size} full sft"
    assert _values(full) == (2e-5, 0, 1.0, 0.01, 0.9, 0.999, 1e-8, 1.0)
    assert (full.train.lr, full.train.warmup_steps, full.train.min_lr_ratio) == (2e-5, 0, 1.0)
    rank = {"1b": 64, "3b": 64, "8b": 8, "70b": 16, "405b": 16}[size]
    for method in ("lora", "qlora"):
        s = make_spec([f"model={size}", f"finetune={method}", long])
        assert _values(s) == (3e-4, 100, 0.0, 0.01, 0.9, 0.999, 1e-8, 1.0)
        assert (s.finetune.rank, s.finetune.alpha) == (rank, 2.0 * rank)
        assert s.objective.beta is None  # (sft: DPO's beta is not the run's)
        dpo = make_spec([f"model={size}", f"finetune={method}", "objective=dpo", long])
        assert dpo.recipe.name == f"{size} {method} dpo"
        assert _values(dpo) == (5e-4, 100, 0.0, 0.05, 0.9, 0.999, 1e-8, 1.0)
        assert dpo.objective.beta == 0.1 and dpo.finetune.rank == rank
    dpo = make_spec([f"model={size}", "objective=dpo", long])
    assert _values(dpo) == (1e-6, 0, 0.0, 0.0, 0.9, 0.999, 1e-8, 1.0)
    assert dpo.objective.beta == 0.1 and dpo.finetune.rank is None


def test_the_tiny_model_keeps_its_tuned_values_for_every_method_and_objective():
    for extra in ([], ["finetune=lora"], ["finetune=qlora"], ["objective=dpo", "finetune=lora"]):
        s = make_spec(extra)
        assert _values(s) == (3e-3, 6, 0.1, 0.0, 0.9, 0.95, 1e-8, 1.0), extra
        assert s.recipe.name.startswith("tiny ")
        if "finetune=lora" in extra:
            assert (s.finetune.rank, s.finetune.alpha) == (16, 32.0)


def test_a_value_the_user_gives_wins_key_by_key_and_is_said_so():
    s = make_spec(["model=8b", "finetune=lora", "train.lr=1e-4", "finetune.rank=32",
                   "train.max_steps=2000"])
    assert (s.train.lr, s.finetune.rank, s.finetune.alpha) == (1e-4, 32, 16.0)
    assert s.recipe.sources["train.lr"] == "train.lr"
    assert s.recipe.sources["finetune.rank"] == "finetune.rank"
    assert s.recipe.sources["train.weight_decay"] == "recipe: 8b lora sft"
    assert s.recipe.recipe["train.lr"] == 3e-4  # what the recipe had: the report compares
    overview = s.overview()
    assert overview["learning rate"] == "1.0e-04 (train.lr)"
    assert overview["hyperparameters"].startswith(
        "warmup_steps 100, min_lr_ratio 0, weight_decay 0.01, beta1 0.9, beta2 0.999, eps "
        "1.0e-08, max_grad_norm 1 (recipe: 8b lora sft); rank 32 (finetune.rank); alpha 16 "
        "(recipe: 8b lora sft)")
    params = s.recipe.params()
    assert params["recipe"] == "8b lora sft" and params["source.train.lr"] == "train.lr"


def test_a_warm_up_longer_than_half_a_short_run_becomes_a_tenth_of_it():
    s = make_spec(["model=8b", "finetune=lora", "train.max_steps=60"])
    assert s.train.warmup_steps == 6
    assert s.recipe.sources["train.warmup_steps"] == (
        "recipe: 8b lora sft: 100, shortened to a tenth of train.max_steps=60")
    assert make_spec(["model=8b", "finetune=lora", "train.max_steps=200"]).train.warmup_steps \
        == 100  # half the run: kept
    # the tiny run of 5 steps, refused before (its warm-up was 6 steps): no warm-up
    assert make_spec(["train.max_steps=5"]).train.warmup_steps == 0
    # a warm-up the user gives is never changed: too long is refused, as before
    from llama_fsdp.run.spec import ConfigError

    with pytest.raises(ConfigError, match=r"train.warmup_steps=10 must be in \[0, "
                                          r"train.max_steps=5\)"):
        make_spec(["train.max_steps=5", "train.warmup_steps=10"])


def test_a_model_of_ones_own_takes_the_recipe_of_its_size():
    s = make_spec(["model=8b", "model.name=my8b", "finetune=lora", "train.max_steps=2000"])
    assert s.recipe.name == "8b lora sft"
    assert s.recipe.sources["train.lr"] == "recipe: 8b lora sft, by size: 8B parameters"
    assert recipes.size_of(make_spec(["model.name=mine"]).model)[0] == "tiny"


def test_the_plan_prints_the_values_and_their_sources_and_a_random_base(tmp_path):
    r = subprocess.run([sys.executable, "-m", "llama_fsdp", "model=8b", "finetune=lora",
                        "train.lr=1e-4", "cluster.device=cpu", "dry_run=true"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-2000:]
    assert "learning rate                  1.0e-04 (train.lr)" in out
    assert ("hyperparameters                warmup_steps 6 (recipe: 8b lora sft: 100, "
            "shortened to a tenth of train.max_steps=60); min_lr_ratio 0, weight_decay 0.01"
            ) in out
    assert out.count("without model.path: the adapters train beside a random base") == 1
