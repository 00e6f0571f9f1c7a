"""Which weights a finished run's commands (evaluate, generate) load, given a run directory, one
of its checkpoints, its export, or any Hugging Face directory; LoRA adapters merged on the fly."""
from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from ..config.rundir import RUN_MARKERS, RunDir, read_run_status
from ..checkpoint.peft import ADAPTER_CONFIG, PEFT_PREFIX

log = logging.getLogger("llama_fsdp.harness.models")


class ModelNotFound(ValueError):
    """What was given holds no model this can load, and what would."""


@dataclass
class Found:
    hf_dir: Path  # an HF directory with the whole model (config.json, safetensors, tokenizer)
    run_dir: Optional[Path]  # the run it came from, when known (its config.yaml, its MLflow run)
    what: str  # said to the user: "the run's export", "checkpoint step_000040 (converted)"
    step: Optional[int] = None


def _is_run(p: Path) -> bool:
    return RunDir(p).config.is_file() and any((p / m).exists() for m in RUN_MARKERS)


def _is_hf(p: Path) -> bool:
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def _is_adapter(p: Path) -> bool:
    return (p / ADAPTER_CONFIG).is_file()


def run_of(p: Path) -> Optional[Path]:
    """The run directory ``p`` is, or is inside of (its export, a checkpoint)."""
    for cand in (p, p.parent, p.parent.parent):
        if _is_run(cand):
            return cand
    return None


def _step_of(checkpoint: Path) -> Optional[int]:
    name = checkpoint.name
    return int(name.split("_")[1]) if name.startswith("step_") and name[5:].isdigit() else None


@contextlib.contextmanager
def resolve(path: Path, *, step: Optional[int] = None) -> Iterator[Found]:
    """The model at ``path``: a run directory (its merged export, its HF export, its PEFT
    adapter merged onto its base, else its newest checkpoint converted; ``step``: that
    checkpoint), a DCP checkpoint (converted), an HF directory, or a PEFT adapter directory
    (merged onto the base it names). Converted and merged models live in a temporary folder
    for the ``with`` block."""
    path = path.expanduser().resolve()
    if not path.exists():
        raise ModelNotFound(f"{path} does not exist: give a run directory (outputs/runs/<day>/"
                            "<time>), one of its checkpoints, or a Hugging Face model folder")
    run = run_of(path)
    with tempfile.TemporaryDirectory(prefix="llama_fsdp-model-") as tmp, _temp_in(Path(tmp)):
        yield _resolve(path, run, step, Path(tmp))


@contextlib.contextmanager
def _temp_in(folder: Path) -> Iterator[None]:
    """Python's temporary files and folders (convert's scratch copy, lm-eval's and datasets')
    inside ``folder`` for the block: one folder to remove however the command ends, even when a
    signal stops a library's own cleanup halfway (harness/checks.py)."""
    inner = folder / "tmp"
    inner.mkdir()
    before = tempfile.tempdir
    tempfile.tempdir = str(inner)
    try:
        yield
    finally:
        tempfile.tempdir = before


def model_folder_problem(hf_dir: Path) -> Optional[str]:
    """Why an HF folder someone else wrote is not loaded: its config.json or
    tokenizer_config.json names classes of its own (auto_map: never run), or config.json is not
    a JSON object (damaged, or nested past any config: named before transformers' parser)."""
    from ..config.hf_dir import read_config_json, remote_code_problem

    if (problem := remote_code_problem(hf_dir, "model")) is not None:
        return problem
    try:
        read_config_json(hf_dir)
    except ValueError as e:
        return str(e)
    return None


def _hf(path: Path, run: Optional[Path], what: str, step: Optional[int]) -> Found:
    if (problem := model_folder_problem(path)) is not None:
        raise ModelNotFound(problem)
    return Found(path, run, what, step)


def _resolve(path: Path, run: Optional[Path], step: Optional[int], tmp: Path) -> Found:
    if step is not None:
        if run is None:
            raise ModelNotFound(f"--step {step}: {path} is not a run directory")
        ckpt = RunDir(run).checkpoints / f"step_{step:06d}"
        if not ckpt.is_dir():
            have = sorted(p.name for p in RunDir(run).checkpoints.glob("step_*")
                          if p.is_dir()) if RunDir(run).checkpoints.is_dir() else []
            raise ModelNotFound(f"{run} has no checkpoint at step {step} (it has: "
                                f"{', '.join(have) or 'none'})")
        return _convert(ckpt, run, tmp)
    if _is_hf(path):
        return _hf(path, run, f"{path}", None)
    if _is_adapter(path):
        return _merge(path, run, tmp)
    if (path / ".metadata").is_file():  # a DCP checkpoint
        return _convert(path, run, tmp)
    if run is not None and path == run:
        rd = RunDir(run)
        at = read_run_status(run).get("step")
        if _is_hf(rd.export_merged):
            return _hf(rd.export_merged, run, "the run's merged export (export_merged/)", at)
        if _is_hf(rd.export):
            return _hf(rd.export, run, "the run's export (export/)", at)
        if _is_adapter(rd.export):
            return _merge(rd.export, run, tmp, at)
        ckpts = sorted(p for p in rd.checkpoints.glob("step_*")
                       if p.is_dir() and (p / ".metadata").is_file()) \
            if rd.checkpoints.is_dir() else []
        if ckpts:
            return _convert(ckpts[-1], run, tmp)
        raise ModelNotFound(
            f"{run} kept no model: no export/ and no checkpoint. Runs keep one with "
            "save.export_hf=true (on by default for the tiny model), finetune.export_merged=true "
            "(LoRA / QLoRA) or save.every_steps=N")
    raise ModelNotFound(f"{path} holds no model: give a run directory, a checkpoint "
                        "(checkpoints/step_N), an HF model folder (config.json + safetensors) or "
                        "a PEFT adapter folder (adapter_config.json)")


def _convert(ckpt: Path, run: Optional[Path], tmp: Path) -> Found:
    from ..checkpoint.convert import convert

    try:
        out = convert(ckpt, tmp / "converted")
    except ValueError as e:  # adapters only: their base is elsewhere
        raise ModelNotFound(str(e)) from None
    return Found(out, run, f"checkpoint {ckpt.name} (converted)", _step_of(ckpt))


def _merge(adapter: Path, run: Optional[Path], tmp: Path, step: Optional[int] = None) -> Found:
    """The adapter's base (adapter_config.json's base_model_name_or_path: an HF folder or a hub
    name in the cache) with W + alpha / r * B A for each adapted projection, written as an HF
    directory with the adapter's tokenizer."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    cfg, scale = adapter_config(adapter)
    base = cfg.get("base_model_name_or_path")
    if not base:
        raise ModelNotFound(
            f"{adapter} is a LoRA adapter trained beside a random base (the run had no "
            "model.path), which no file holds: its run's export_merged/ has the model "
            "(finetune.export_merged=true)")
    if not (adapter / "adapter_model.safetensors").is_file():
        raise ModelNotFound(f"{adapter} has {ADAPTER_CONFIG} but no adapter_model.safetensors: "
                            "export the adapter again")
    model = _base_model(adapter, str(base))
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    merged = 0
    for key, a in weights.items():
        if ".lora_A." not in key:
            continue
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        target = name.replace(".lora_A.weight", ".weight")
        b = weights.get(key.replace(".lora_A.", ".lora_B."))
        if target not in params or b is None:
            raise ModelNotFound(f"{adapter}: {key} adapts {target}, which the base {base} does "
                                "not have (or has no lora_B beside it): not this base's adapter")
        with torch.no_grad():
            params[target].add_(scale * (b.float() @ a.float()))
        merged += 1
    out = tmp / "merged"
    model.save_pretrained(str(out))
    tok_src = adapter if (adapter / "tokenizer_config.json").is_file() else base
    AutoTokenizer.from_pretrained(str(tok_src), trust_remote_code=False).save_pretrained(str(out))
    log.info("merged %d LoRA adapters of %s onto %s", merged, adapter, base)
    return Found(out, run, f"{adapter} merged onto {base}", step)


def adapter_config(adapter: Path) -> tuple[dict[str, Any], float]:
    """adapter_config.json, and the adapters' scale (lora_alpha / r): ModelNotFound naming the
    file when it is not a JSON object (damaged, nested past any config) or r and lora_alpha are
    not positive numbers."""
    import math

    f = adapter / ADAPTER_CONFIG
    try:
        cfg = json.loads(f.read_text())
    except RecursionError:
        raise ModelNotFound(f"{f} nests JSON deeper than any config does: a damaged or hostile "
                            "file; export the adapter again") from None
    except (ValueError, OSError) as e:
        raise ModelNotFound(f"{f} is not a readable JSON file ({e}): export the adapter "
                            "again") from None
    if not isinstance(cfg, dict):
        raise ModelNotFound(f"{f} holds a JSON {type(cfg).__name__}, not an adapter's config")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ModelNotFound(f"{f}: r is {r!r}, not a rank >= 1: the file is damaged; export the "
                            "adapter again")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) \
            or not math.isfinite(alpha) or alpha <= 0:
        raise ModelNotFound(f"{f}: lora_alpha is {alpha!r}, not a positive number: the file is "
                            "damaged; export the adapter again")
    return cfg, float(alpha) / float(r)


def _base_model(adapter: Path, base: str) -> Any:
    """The adapter's base model: a folder (checked as any model folder), or a hub name in the
    cache; ModelNotFound saying what adapter_config.json names when it is neither."""
    import torch
    from transformers import AutoModelForCausalLM

    local = Path(base).expanduser()
    named = f"{adapter / ADAPTER_CONFIG} names the base model {base} (base_model_name_or_path)"
    if local.is_absolute() or base.startswith((".", "~")) or local.exists():
        if not local.is_dir():
            raise ModelNotFound(f"{named}, which does not exist here: put the base model there, "
                                "or set base_model_name_or_path to its folder")
        if (problem := model_folder_problem(local)) is not None:
            raise ModelNotFound(problem)
    try:
        return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                    trust_remote_code=False)
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ModelNotFound(f"{named}, which cannot be loaded ({first}): download it, or set "
                            "base_model_name_or_path to its folder") from None
