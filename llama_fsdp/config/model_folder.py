"""A model is its folder: with ``model.path`` and the default model group, the run's shape,
name and size come from the folder's config.json (as the HF Trainer, TRL and axolotl read it).

A named shape (``model=8b``) stays a shape to check the folder against (run/checks.py refuses a
folder that disagrees); the default group (``model=tiny``, untouched) gives way to the folder.
Torch-free: build_spec calls this before the recipe is picked (by the folder's size).

What the project's Llama does not implement is refused here, naming it: another
architecture, attention or MLP biases, an activation other than SwiGLU's SiLU, a rope type
other than the default and Llama 3's, a head_dim that is not hidden_size / num_heads.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from .hf_dir import hf_config_problems, hf_shape, hub_name, model_shape, read_config_json
from .schema import ModelConfig, RopeScalingConfig

DEFAULT_MODEL = "tiny"  # conf/config.yaml's model group: the shape a folder replaces
LLAMA = "llama"
LLAMA_CLASS = "LlamaForCausalLM"
# rope_type -> what the project's rotary embedding does with it (model/llama.rope_parameters)
ROPE_TYPES = {"default": "plain RoPE", "llama3": "Llama 3.1's frequency scaling"}
ACTIVATIONS = ("silu",)  # SwiGLU's gate activation, the only one a Llama MLP has


def folder_config(path: str) -> Optional[dict[str, Any]]:
    """config.json of a local folder or a hub name (its config.json alone, from the hub
    cache or downloaded); None when it cannot be read (run/checks.py says why)."""
    local = Path(path).expanduser()
    try:
        if local.is_dir():
            return read_config_json(local)
        if path.count("/") != 1 or path.startswith((".", "/", "~")):
            return None
        from huggingface_hub import hf_hub_download

        return read_config_json(Path(hf_hub_download(path, "config.json")).parent)
    except Exception:  # noqa: BLE001 - any failure is reported by model_path_problems
        return None


def architecture_problems(hf: dict[str, Any], path: str) -> list[str]:
    """What in config.json the project's Llama does not implement, each named with its key."""
    where = f"model.path={path}"
    kind, classes = hf.get("model_type", LLAMA), hf.get("architectures") or [LLAMA_CLASS]
    if kind != LLAMA or LLAMA_CLASS not in classes:
        return [f"{where} is a {kind!r} model ({', '.join(map(str, classes))}); only Llama "
                f"models ({LLAMA_CLASS}) train here"]
    out = [f"{where}: config.json has {key}=true (bias terms in the {what}); the project's "
           "Llama has none, so they would be dropped: use a model without them"
           for key, what in (("attention_bias", "attention projections"),
                             ("mlp_bias", "MLP projections")) if hf.get(key)]
    act = hf.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        out.append(f"{where}: config.json has hidden_act={act!r}; a Llama MLP gates with "
                   f"{', '.join(ACTIVATIONS)}")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ROPE_TYPES:
        out.append(f"{where}: config.json's rope type is {kind!r}, which llama_fsdp does not "
                   f"implement (it has {', '.join(f'{k}: {v}' for k, v in ROPE_TYPES.items())})")
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    head_dim = hf.get("head_dim")
    if head_dim and isinstance(heads, int) and isinstance(hidden, int) and heads \
            and head_dim != hidden // heads:
        out.append(f"{where}: config.json has head_dim={head_dim}, not hidden_size / "
                   f"num_attention_heads = {hidden // heads}; llama_fsdp's Llama derives it")
    return out


def display_name(path: str) -> str:
    """The model's name for the run, its plan and MLflow: the folder's name (a hub snapshot's
    repository name)."""
    return hub_name(str(path).rstrip("/")).split("/")[-1] or str(path)


def is_default_shape(m: ModelConfig) -> bool:
    """The model group as composed by default, no shape key overridden."""
    from .schema import model_presets

    preset = model_presets().get(DEFAULT_MODEL)
    return m.name == DEFAULT_MODEL and preset is not None \
        and model_shape(m) == model_shape(preset) \
        and m.max_position_embeddings == preset.max_position_embeddings


def shape_from_folder(m: ModelConfig) -> Optional[ModelConfig]:
    """``m`` with the folder's shape and name when ``model.path`` is set and the model group is
    the default; None otherwise, or when the folder cannot be read or is not a Llama the
    project implements (model_path_problems reports it)."""
    if not m.path or not is_default_shape(m):
        return None
    hf = folder_config(m.path)
    if hf is None or hf_config_problems(hf, Path("config.json")) \
            or architecture_problems(hf, m.path):
        return None
    shape = hf_shape(hf)
    rs = shape.pop("rope_scaling")
    return dataclasses.replace(
        m, name=display_name(m.path), **shape,
        rope_scaling=RopeScalingConfig(**rs) if rs else None,
        max_position_embeddings=int(hf.get("max_position_embeddings")
                                    or m.max_position_embeddings))


def adopt_folder_shape(cfg: Any) -> Any:
    """The composed config (a DictConfig or a Config) with the folder's model when
    ``shape_from_folder`` gives one; else as it was. A DictConfig stays one, so that the run's
    config.yaml and MLflow params carry the folder's shape and name."""
    from omegaconf import DictConfig, OmegaConf

    from .schema import model_config_from_node

    node = cfg.model
    try:
        typed = model_config_from_node(node) if isinstance(node, DictConfig) else node
    except Exception:  # noqa: BLE001 - a node that does not validate: typed_config says why
        return cfg
    new = shape_from_folder(typed)
    if new is None:
        return cfg
    if isinstance(cfg, DictConfig):
        out = cfg.copy()
        out.model = OmegaConf.structured(new)
        return out
    return dataclasses.replace(cfg, model=new)
