"""The recipe table: which values a run takes for its size, method and objective, that a value
the user gives wins (and is said so), how a short run's warm-up is shortened, and what the
plan prints (docs/recipes.md)."""
from __future__ import annotations

import re
import subprocess

import pytest

from llama_fsdp.config import recipes
from tests.conftest import REPO, make_spec
from tests import warm

OPTIM = ("train.lr", "train.warmup_steps", "train.min_lr_ratio", "train.weight_decay",
         "train.beta1", "train.beta2", "train.eps", "train.max_grad_norm")
DOC = REPO / "docs" / "recipes.md"


def _values(spec, keys=OPTIM):
    return tuple(spec.recipe.values[k] for k in keys)


def doc_table() -> list[dict[str, str]]:
    """docs/recipes.md's recipe table, a dict per row (its header's names): what the code is
    held to, so that a value typed wrong in recipes.py is not typed wrong again in a test."""
    text = DOC.read_text()
    lines = text[text.index("\n| recipe | lr |") + 1:].split("\n\n", 1)[0].splitlines()

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.split("|")[1:-1]]

    header = cells(lines[0])
    assert header[:4] == ["recipe", "lr", "warm-up", "schedule"], header
    return [dict(zip(header, cells(line))) for line in lines[2:]]


def _cases(row: dict[str, str], all_sizes: list[str]) -> list[tuple[str, str, str]]:
    """(size, method, objective) a row of the table covers: "tiny (any method, any
    objective)", "1b, 3b, 8b full sft", "1b ... 405b lora / qlora dpo"."""
    label = row["recipe"]
    if label.startswith("tiny"):
        return [("tiny", m, o) for m in ("full", "lora", "qlora") for o in ("sft", "dpo")]
    sizes, methods, objective = re.fullmatch(r"(.+?) ((?:full|lora / qlora)) (sft|dpo)",
                                             label).groups()
    sizes = all_sizes if "..." in sizes else sizes.split(", ")
    return [(s, m, objective) for s in sizes for m in methods.split(" / ")]


def _expected(row: dict[str, str], size: str, method: str, rows: list[dict[str, str]]) -> dict:
    """The values a row states, by config key (a blank cell: the key is not the run's)."""
    betas = [float(x) for x in row["betas, eps"].split(", ")]
    ratio = re.search(r"to ([\d.]+)", row["schedule"])
    want = dict(zip(OPTIM, (float(row["lr"]), int(row["warm-up"]),
                            float(ratio.group(1)) if ratio else 1.0,  # "constant"
                            float(row["weight decay"]), *betas, float(row["clip"]))))
    cell, rank, alpha = row["rank / alpha"], None, None
    if cell == "as sft":
        cell = next(r["rank / alpha"] for r in rows if r["recipe"].endswith("lora / qlora sft"))
    for part in cell.split("; "):  # "16 / 32", or "1b, 3b: 64 / 128; 8b: 8 / 16"
        sizes, _, pair = part.rpartition(": ")
        if not sizes or size in sizes.split(", "):
            rank, alpha = pair.split(" / ") if pair else (None, None)
    adapters = method != "full"
    want["finetune.rank"] = int(rank) if adapters and rank else None
    want["finetune.alpha"] = float(alpha) if adapters and alpha else None
    want["objective.beta"] = float(row["DPO beta"]) if row["DPO beta"] else None
    return want


TABLE = doc_table()
# "<1B, 1b, 3b, 8b, 70b, 405b full sft": the pretrained sizes (<1B: a folder of pretrained
# weights under the 1b shape's size, the one a named shape cannot select)
SIZES = TABLE[1]["recipe"].split(" full")[0].split(", ")


@pytest.fixture(scope="module")
def small_pretrained(tmp_path_factory):
    """A folder of a pretrained model under 1B parameters (its weights: a token file; the spec
    reads config.json), which takes the <1B recipe; the tiny shape's widths, whose weights
    QLoRA's NF4 groups split over 2 shards."""
    from tests.unit.test_model_folder import folder

    return folder(tmp_path_factory.mktemp("small") / "pretrained-mini", hidden_size=256,
                  num_attention_heads=8, num_key_value_heads=4, intermediate_size=768)


def _size(size: str, folder) -> str:
    return f"model.path={folder}" if size == recipes.SMALL_PRETRAINED else f"model={size}"


@pytest.mark.parametrize("row", TABLE, ids=[r["recipe"] for r in TABLE])
def test_each_size_method_and_objective_takes_the_values_docs_recipes_md_states(
        row, small_pretrained):
    long = "train.max_steps=2000"  # (no warm-up shortened)
    cases = _cases(row, SIZES)
    assert cases, row
    for size, method, objective in cases:
        s = make_spec([_size(size, small_pretrained), f"finetune={method}",
                       f"objective={objective}", long])
        want = _expected(row, size, method, TABLE)
        case = (size, method, objective)
        assert dict(zip(OPTIM, _values(s))) == {k: want[k] for k in OPTIM}, case
        assert (s.train.lr, s.train.warmup_steps, s.train.min_lr_ratio) == tuple(
            want[k] for k in OPTIM[:3]), case  # what the run uses
        assert (s.finetune.rank, s.finetune.alpha) == (want["finetune.rank"],
                                                       want["finetune.alpha"]), case
        # DPO's beta is the run's under objective=dpo only
        assert s.objective.beta == (want["objective.beta"] if objective == "dpo" else None), case
        if size == recipes.SMALL_PRETRAINED:
            assert s.recipe.name == f"pretrained {size} {method} {objective}", case
        elif size != "tiny":  # (tiny's one recipe, whatever the method)
            assert s.recipe.name == f"{size} {method} {objective}", case
        else:
            assert s.recipe.name.startswith("tiny "), (case, s.recipe.name)


def test_the_table_covers_every_size_method_and_objective():
    covered = {c for row in TABLE for c in _cases(row, SIZES)}
    assert covered == {(s, m, o) for s in ["tiny", *SIZES] for m in ("full", "lora", "qlora")
                       for o in ("sft", "dpo")}
    assert SIZES == [recipes.SMALL_PRETRAINED, *(s for s, _ in recipes.SIZES if s != "tiny")]


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
    r = subprocess.run([warm.python(), "-m", "llama_fsdp", "model=8b", "finetune=lora",
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
