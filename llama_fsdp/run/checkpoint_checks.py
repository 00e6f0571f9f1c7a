"""Weights in and out, checked before any process starts: model.path against the model group,
resume targets, save options."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config.schema import Config, ModelConfig, model_presets
from ..config.hf_dir import hf_shape, model_file_problems, read_config_json, shape_diff
from ..config.rundir import OPTIM_META, RunDir, claim_problem
from ..checkpoint.layout import METADATA, export_problem, resolve_resume, resume_candidates, verify
from ..checkpoint.pickles import check_file
from ..checkpoint.optim_meta import optim_mismatch


def _override(field: str, value: Any) -> str:
    if field == "rope_scaling":
        return "model.rope_scaling=null" if value is None else (
            "model.rope_scaling={" + ",".join(f"{k}:{v}" for k, v in value.items()) + "}")
    return f"model.{field}={str(value).lower() if isinstance(value, bool) else value}"


def suggest_model_option(hf: dict[str, Any]) -> str:
    """The model= option (plus overrides) whose shape equals a config.json."""
    shape = {"hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
             "vocab_size"}
    best = None
    for name, node in model_presets().items():
        diff = shape_diff(node, hf)
        if not shape & set(diff) and (best is None or len(diff) < len(best[1])):
            best = (name, diff)
    if best is not None:
        return " ".join([f"model={best[0]}", *(_override(k, v[1]) for k, v in best[1].items())])
    return " ".join(_override(k, v) for k, v in hf_shape(hf).items() if v is not None)


def _local_hf_problems(path: Path) -> list[str]:
    if not (path / "config.json").is_file():
        return [f"model.path={path} has no config.json: point it at a Hugging Face model "
                "directory (config.json + *.safetensors) or a hub name"]
    if not any(path.glob("*.safetensors")):
        return [f"model.path={path} has no *.safetensors files (only safetensors weights are "
                "read; convert .bin checkpoints with transformers' save_pretrained first)"]
    return [f"model.path: {p}" for p in model_file_problems(path)]


def model_path_problems(m: ModelConfig) -> list[str]:
    """model.path must be an HF Llama directory or hub name whose config.json matches the group."""
    if not m.path:
        return []
    local = Path(m.path).expanduser()
    if local.is_dir():
        problems = _local_hf_problems(local)
        if problems:
            return problems
        hf = read_config_json(local)
    elif local.exists() or m.path.startswith((".", "/", "~")) or m.path.count("/") != 1:
        return [f"model.path={m.path} is neither a directory nor a hub name (org/name)"]
    else:
        try:
            from huggingface_hub import hf_hub_download

            hf = read_config_json(Path(hf_hub_download(m.path, "config.json")).parent)
        except Exception as e:  # noqa: BLE001 - any hub failure is a config problem to report
            return [f"model.path={m.path}: not a local directory, and the hub lookup of its "
                    f"config.json failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"]
    if hf.get("model_type", "llama") != "llama":
        return [f"model.path={m.path} is a {hf.get('model_type')!r} model; only Llama loads here"]
    diff = shape_diff(m, hf)
    if not diff:
        return []
    fields = ", ".join(f"{k}: model.{k}={ours} but config.json has {theirs}"
                       for k, (ours, theirs) in diff.items())
    return [f"model={m.name} does not match model.path={m.path} ({fields}): use "
            f"{suggest_model_option(hf)}"]


def resume_problems(resume: str, output_dir: str) -> list[str]:
    """resume=auto and resume=none always work; a path must be a checkpoint or a run directory
    with complete checkpoints."""
    if resume in ("auto", "none"):
        return []
    if not Path(resume).exists():
        return [f"resume={resume!r} does not exist: use resume=auto, resume=none or an existing "
                "checkpoint directory"]
    try:
        resolve_resume(resume, output_dir)
    except FileNotFoundError as e:
        return [f"{e}: use resume=auto, resume=none or a checkpoint directory"]
    return []


def resume_pickle_problems(cfg: Config) -> list[str]:
    """A checkpoint this run may resume from whose .metadata would load more than DCP's
    metadata classes (pickles.py): refused before any process starts."""
    try:
        candidates = resume_candidates(cfg.resume, cfg.output_dir)
    except (FileNotFoundError, OSError):  # resume_problems reports it
        return []
    return [why for path in candidates if (path / METADATA).is_file()
            and (why := check_file(path / METADATA)) is not None]


def resume_optim_problems(cfg: Config) -> list[str]:
    """The checkpoint to resume from holds another optimizer's state, or what another finetune
    method trains (optim_meta.py)."""
    try:
        path = resolve_resume(cfg.resume, cfg.output_dir)
    except (FileNotFoundError, OSError):  # resume_problems reports it
        return []
    if path is None or verify(path) is not None:  # a damaged one: the ranks skip it, saying so
        return []
    try:
        why = optim_mismatch(path, cfg.optim, cfg.finetune)
    except (ValueError, KeyError, TypeError) as e:
        return [f"{path / OPTIM_META} is unreadable ({type(e).__name__}: {e}): resume from "
                "another checkpoint with resume=<path>, or start afresh with resume=none"]
    return [why] if why else []


def export_problems(cfg: Config) -> list[str]:
    """The run's export would replace a directory that is not wholly an earlier export of
    llama_fsdp's (the user's files in <run>/export): refused now, not after training."""
    run = RunDir(cfg.output_dir)
    if claim_problem(run.root) is not None:  # not a run's directory: refused as a whole at launch
        return []
    outs = []
    if cfg.finetune.adapters or cfg.save.export_hf:
        outs.append(run.export)
    if cfg.finetune.adapters and cfg.finetune.export_merged:
        outs.append(run.export_merged)
    return [f"this run's export would replace what is there: {why}" for p in outs
            if (why := export_problem(p)) is not None]


def checkpoint_problems(cfg: Config) -> list[str]:
    """Everything about weights in and out that can be wrong before any process starts."""
    problems = model_path_problems(cfg.model) + resume_problems(cfg.resume, cfg.output_dir)
    problems += resume_pickle_problems(cfg) + resume_optim_problems(cfg) + export_problems(cfg)
    s, stop = cfg.save, cfg.train.stop_after
    if s.async_save and s.full_state_dict:
        problems.append("save.async_save=true with save.full_state_dict=true: the full state dict "
                        "is gathered and written by rank 0 synchronously; drop one of them")
    if stop is not None and not 1 <= stop <= cfg.train.max_steps:
        problems.append(f"train.stop_after={stop} must be in [1, train.max_steps="
                        f"{cfg.train.max_steps}] (or null)")
    return problems

