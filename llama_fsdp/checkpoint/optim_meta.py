"""Which optimizer wrote a checkpoint's state, and over which trainable parameters
(``optimizer.json`` in the checkpoint), so a run resumes only with an optimizer that can read
it and the same finetune method and adapters (a lora checkpoint holds the adapters alone; a
full one every weight). torchao's low-bit moments (OptimState8bit /
4bit codes of one block size) load only into the same kind and block size, and its optimizers
keep the learning rate as a tensor where torch's AdamW keeps a float (the LR scheduler's state
differs). Torch-free: run/checks.py compares before launch, the Checkpointer again on resume.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..config.schema import FinetuneConfig, OptimConfig
from ..config.rundir import OPTIM_META


def state_format(o: OptimConfig) -> str:
    """What the optimizer's state looks like: equal strings load into each other."""
    if o.lowbit:
        return f"{o.name}, block {o.block}"
    return f"{o.name}, torchao (bf16 stochastic rounding)" if o.bf16_stochastic_round else o.name


def trained(ft: FinetuneConfig) -> str:
    """What trains, as far as the checkpoint's tensors go: equal strings load into each other."""
    if not ft.adapters:
        return "full"
    return f"{ft.method}, rank {ft.rank}, on {','.join(sorted(ft.target_modules))}"


def write_optim_meta(checkpoint: Path, o: OptimConfig,
                     ft: Optional[FinetuneConfig] = None) -> None:
    ft = ft or FinetuneConfig()
    (checkpoint / OPTIM_META).write_text(json.dumps(
        {"name": o.name, "block_size": o.block_size, "bf16_stochastic_round":
         o.bf16_stochastic_round, "format": state_format(o),
         "finetune": {"method": ft.method, "rank": ft.rank,
                      "target_modules": list(ft.target_modules)}}, indent=1) + "\n")


def read_finetune_meta(checkpoint: Path) -> FinetuneConfig:
    """What trained into a checkpoint; every weight for checkpoints written before the record
    existed (full fine-tuning was the only method then)."""
    path = checkpoint / OPTIM_META
    d = json.loads(path.read_text()).get("finetune") if path.is_file() else None
    if d is None:
        return FinetuneConfig()
    return FinetuneConfig(method=d["method"], rank=d["rank"],
                          target_modules=list(d["target_modules"]))


def read_optim_meta(checkpoint: Path) -> OptimConfig:
    """The optimizer that wrote a checkpoint; torch's AdamW for checkpoints written before
    the file existed (AdamW was the only optimizer then)."""
    path = checkpoint / OPTIM_META
    if not path.is_file():
        return OptimConfig()
    d = json.loads(path.read_text())
    return OptimConfig(name=d["name"], block_size=d["block_size"],
                       bf16_stochastic_round=d["bf16_stochastic_round"])


def _overrides(saved: OptimConfig, ours: OptimConfig) -> str:
    """The optim overrides that make ``ours`` read ``saved``'s state."""
    out = [f"optim={saved.name}"]
    if saved.lowbit and (saved.block_size is not None or ours.block_size is not None):
        out.append(f"optim.block_size={saved.block}")
    if not saved.lowbit and saved.bf16_stochastic_round != ours.bf16_stochastic_round:
        out.append(f"optim.bf16_stochastic_round={str(saved.bf16_stochastic_round).lower()}")
    return " ".join(out)


def finetune_mismatch(checkpoint: Path, ft: FinetuneConfig) -> Optional[str]:
    """Why this run's finetune method cannot resume from the checkpoint (with the fix), or
    None."""
    saved = read_finetune_meta(checkpoint)
    if trained(saved) == trained(ft):
        return None
    fix = f"finetune={saved.method}"
    if saved.adapters:
        fix += (f" finetune.rank={saved.rank} "
                f"finetune.target_modules=[{','.join(saved.target_modules)}]")
    return (f"{checkpoint} holds what finetune {trained(saved)!r} trains, not what "
            f"{trained(ft)!r} trains: resume with {fix}, or start afresh with resume=retire "
            "(which moves its checkpoints aside)"
            + (" (to put adapters on a fully fine-tuned model, export it with "
               "save.export_hf=true and give its directory as model.path)"
               if not saved.adapters else ""))


def optim_mismatch(checkpoint: Path, o: OptimConfig,
                   ft: Optional[FinetuneConfig] = None) -> Optional[str]:
    """Why this run's optimizer (or, given ``ft``, its finetune method) cannot resume from the
    checkpoint (with the fix), or None."""
    if ft is not None and (why := finetune_mismatch(checkpoint, ft)) is not None:
        return why
    saved = read_optim_meta(checkpoint)
    if state_format(saved) == state_format(o):
        return None
    return (f"{checkpoint} holds the state of optim {state_format(saved)!r}, which optim "
            f"{state_format(o)!r} cannot read: resume with {_overrides(saved, o)}, or start "
            "afresh with resume=retire (which moves its checkpoints aside)")
