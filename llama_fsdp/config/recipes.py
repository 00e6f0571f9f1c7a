"""The optimizer's hyperparameters a run uses when the config leaves them unset (null), chosen
from the model's size, the fine-tuning method and the objective.

Each value comes from a recipe users trust (docs/recipes.md has the table with the file each
value was read from): torchtune's Llama 3 / 3.1 / 3.2 / 3.3 configs, TRL's DPOConfig and
Hugging Face's TrainingArguments, Meta's llama-cookbook. Weights from ``model.path`` are
pretrained: their recipe is named so and picked by their parameter count (``pretrained <1B lora
sft`` for a 135M model: torchtune's smallest Llama recipe, Llama 3.2 1B's). The from-scratch
recipe (the values the random tiny model was tuned with) is only for random weights below the
1B size. A value the user gives always wins (``resolve``), and the run says where each value
came from: ``lr 3.0e-04 (recipe: 8b lora sft)`` or ``lr 1.0e-04 (train.lr)``.

A recipe's warm-up that would take more than half of a short run is shortened to a tenth of
it, and the plan says so (torchtune's 100 warm-up steps in a 60-step run would never reach
the peak learning rate).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

# The keys a recipe sets, as config paths (group.key). finetune.* only under lora / qlora;
# objective.beta only under an objective with pairs (dpo).
TRAIN_KEYS = ("lr", "warmup_steps", "min_lr_ratio", "weight_decay", "beta1", "beta2", "eps",
              "max_grad_norm")
ADAPTER_KEYS = ("rank", "alpha")
LR = "train.lr"  # the key the report of a diverged run reads
KEYS = tuple(f"train.{k}" for k in TRAIN_KEYS) + tuple(f"finetune.{k}" for k in ADAPTER_KEYS) \
    + ("objective.beta",)

# Sizes by parameter count, for a model whose name is not a row of the table (a config of
# one's own, a model folder): the largest size whose parameters it reaches.
SIZES = (("tiny", 0), ("1b", 0.5e9), ("3b", 2e9), ("8b", 5e9), ("70b", 30e9), ("405b", 200e9))
FROM_SCRATCH = "tiny"  # the size below 1b, for random weights: the from-scratch recipe
SMALL_PRETRAINED = "<1B"  # the size below 1b, for pretrained weights
PRETRAINED = "pretrained"  # the recipe name's prefix for weights from model.path

# torch.optim.AdamW's defaults, which torchtune's, TRL's and the cookbook's AdamW all keep
ADAMW = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
# Hugging Face TrainingArguments.max_grad_norm (TRL's default too). torchtune does not clip
# (clip_grad_norm: null); a clip at 1.0 costs nothing when the norm is below it and keeps one
# bad batch from throwing the weights away.
CLIP = {"max_grad_norm": 1.0}

# torchtune llama3_1/8B_full.yaml (and every Llama 3.x *_full.yaml): AdamW lr 2e-5 with no
# lr_scheduler (constant, no warm-up); weight decay AdamW's default 0.01.
FULL_SFT = {"lr": 2e-5, "warmup_steps": 0, "min_lr_ratio": 1.0, "weight_decay": 0.01,
            **ADAMW, **CLIP}
# torchtune llama3_1/8B_lora.yaml, 8B_qlora_single_device.yaml (and every Llama 3.x LoRA /
# QLoRA config): AdamW lr 3e-4, weight_decay 0.01, cosine to 0 after 100 warm-up steps.
LORA_SFT = {"lr": 3e-4, "warmup_steps": 100, "min_lr_ratio": 0.0, "weight_decay": 0.01,
            **ADAMW, **CLIP}
# TRL DPOConfig (learning_rate 1e-6, beta 0.1) over TrainingArguments (linear decay to 0, no
# warm-up, weight_decay 0, max_grad_norm 1.0): full-weight DPO.
FULL_DPO = {"lr": 1e-6, "warmup_steps": 0, "min_lr_ratio": 0.0, "weight_decay": 0.0,
            **ADAMW, **CLIP, "beta": 0.1}
# torchtune llama3_1/8B_lora_dpo.yaml: AdamW lr 5e-4, weight_decay 0.05, cosine after 100
# warm-up steps, DPOLoss beta 0.1.
LORA_DPO = {"lr": 5e-4, "warmup_steps": 100, "min_lr_ratio": 0.0, "weight_decay": 0.05,
            **ADAMW, **CLIP, "beta": 0.1}
# torchtune's LoRA rank by size (alpha = 2 x rank, dropout 0): llama3_2/1B_lora.yaml and
# 3B_lora.yaml r 64; llama3_1/8B_lora.yaml r 8; llama3_3/70B_lora.yaml, llama3_1/405B_qlora.yaml
# r 16.
LORA_RANK = {"1b": 64, "3b": 64, "8b": 8, "70b": 16, "405b": 16}
# Pretrained models below 1B (SmolLM2 135M / 360M, Qwen2.5 0.5B): torchtune has no Llama recipe
# smaller than Llama 3.2 1B's (llama3_2/1B_full.yaml, 1B_lora.yaml), which they take; TRL's
# SFTConfig keeps 2e-5 for full SFT too.
LORA_RANK[SMALL_PRETRAINED] = LORA_RANK["1b"]
# The tiny random-init model: the values it was tuned with on CPU (any method, any objective).
TINY = {"lr": 3e-3, "warmup_steps": 6, "min_lr_ratio": 0.1, "weight_decay": 0.0,
        "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "max_grad_norm": 1.0, "rank": 16,
        "alpha": 32.0, "beta": 0.1}


def recipe_values(size: str, method: str, pairs: bool) -> dict[str, Any]:
    """The recipe's values of ``KEYS`` (short names) for a size, method and objective."""
    if size == FROM_SCRATCH:
        return dict(TINY)
    adapters = method != "full"
    if pairs:
        base = LORA_DPO if adapters else FULL_DPO
    else:
        base = {**(LORA_SFT if adapters else FULL_SFT), "beta": TINY["beta"]}
    rank = LORA_RANK[size]
    return {**base, "rank": rank, "alpha": float(2 * rank)}


def approx_params(m: Any) -> int:
    """A Llama's parameters from its shape (embeddings, layers, head): enough to pick a size."""
    h, layers, i, v = m.hidden_size, m.num_layers, m.intermediate_size, m.vocab_size
    head_dim = h // max(m.num_heads, 1)
    attn = 2 * h * h + 2 * h * m.num_kv_heads * head_dim
    per_layer = attn + 3 * h * i + 2 * h
    return v * h * (1 if m.tie_word_embeddings else 2) + layers * per_layer + h


def size_of(m: Any, *, pretrained: bool = False) -> tuple[str, str]:
    """The recipe size of a model config and why: its name, or its parameter count. Pretrained
    weights below 1B are ``<1B``, never the from-scratch size."""
    if m.name in dict(SIZES) and not (pretrained and m.name == FROM_SCRATCH):
        return m.name, ""
    n = approx_params(m)
    size = [s for s, floor in SIZES if n >= floor][-1]
    if pretrained and size == FROM_SCRATCH:
        size = SMALL_PRETRAINED
    return size, f"by size: {n / 1e9:.2g}B parameters"


@dataclass(frozen=True)
class Recipe:
    """The values a run uses for ``KEYS`` and where each came from."""

    name: str  # "8b lora sft"
    values: dict[str, Any]  # config path -> the value in use
    recipe: dict[str, Any]  # config path -> the recipe's value (before any override)
    sources: dict[str, str]  # config path -> "recipe: 8b lora sft" | "train.lr"

    def grouped(self, keys: Optional[list[str]] = None) -> str:
        """Keys in a row, the source said once for each run of keys that share it:
        ``warmup_steps 6, weight_decay 0.01 (recipe: 8b lora sft); beta1 0.8 (train.beta1)``."""
        parts: list[tuple[str, list[str]]] = []
        for key in keys if keys is not None else list(self.values):
            item = f"{key.split('.')[-1]} {show(self.values[key])}"
            if parts and parts[-1][0] == self.sources[key]:
                parts[-1][1].append(item)
            else:
                parts.append((self.sources[key], [item]))
        return "; ".join(f"{', '.join(items)} ({src})" for src, items in parts)

    def params(self) -> dict[str, str]:
        """MLflow params: the recipe's name and each key's source (the values themselves are
        the params of the config keys)."""
        return {"recipe": self.name,
                **{f"source.{key}": src for key, src in self.sources.items()}}


def show(v: Any) -> str:
    if isinstance(v, float) and v and (abs(v) < 1e-2 or abs(v) >= 1e4):
        return f"{v:.1e}"
    return f"{v:g}" if isinstance(v, float) else str(v)


def resolve(cfg: Any, *, pairs: bool) -> tuple[Any, Recipe]:
    """The config with every unset recipe key (None) set from the recipe of its model size,
    whether its weights are pretrained (model.path), its method and objective, and the Recipe
    that says where each value came from. ``pairs``: the objective trains on preference pairs
    (config/objectives.py)."""
    pretrained = bool(cfg.model.path)
    size, why = size_of(cfg.model, pretrained=pretrained)
    method, objective = cfg.finetune.method, cfg.objective.name
    name = f"{PRETRAINED + ' ' if pretrained else ''}{size} {method} {objective}"
    label = f"recipe: {name}" + (f", {why}" if why else "")
    table = recipe_values(size, method, pairs)
    keys = [f"train.{k}" for k in TRAIN_KEYS]
    keys += [f"finetune.{k}" for k in ADAPTER_KEYS] if cfg.finetune.method != "full" else []
    keys += ["objective.beta"] if pairs else []
    groups: dict[str, dict[str, Any]] = {"train": {}, "finetune": {}, "objective": {}}
    values, recipe, sources = {}, {}, {}
    for key in keys:
        group, short = key.split(".")
        given = getattr(getattr(cfg, group), short)
        recipe[key] = table[short]
        if given is not None:
            values[key], sources[key] = given, key
            continue
        value, source = table[short], label
        if short == "warmup_steps":
            value, source = fit_warmup(value, cfg.train.max_steps, label)
        values[key], sources[key] = value, source
        groups[group][short] = value
    # (the keys a run does not use stay unset: rank and alpha under full, beta under sft)
    out = cfg
    for group, changes in groups.items():
        if changes:
            out = dataclasses.replace(out, **{group: dataclasses.replace(
                getattr(out, group), **changes)})
    return out, Recipe(name, values, recipe, sources)


def fit_warmup(steps: int, max_steps: int, label: str) -> tuple[int, str]:
    """A recipe's warm-up of more than half the run: a tenth of the run, said in its source."""
    if max_steps < 1 or 2 * steps <= max_steps:
        return steps, label
    short = max_steps // 10
    return short, (f"{label}: {steps}, shortened to a tenth of train.max_steps={max_steps}")
