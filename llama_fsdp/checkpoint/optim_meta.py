"""Which optimizer wrote a checkpoint's state (``optimizer.json`` in the checkpoint), so a run
resumes only with an optimizer that can read it. torchao's low-bit moments (OptimState8bit /
4bit codes of one block size) load only into the same kind and block size, and its optimizers
keep the learning rate as a tensor where torch's AdamW keeps a float (the LR scheduler's state
differs). Torch-free: checks.py compares before launch, the Checkpointer again on resume.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..config import OptimConfig
from ..rundir import OPTIM_META


def state_format(o: OptimConfig) -> str:
    """What the optimizer's state looks like: equal strings load into each other."""
    if o.lowbit:
        return f"{o.name}, block {o.block}"
    return "adamw, torchao (bf16 stochastic rounding)" if o.bf16_stochastic_round else "adamw"


def write_optim_meta(checkpoint: Path, o: OptimConfig) -> None:
    (checkpoint / OPTIM_META).write_text(json.dumps(
        {"name": o.name, "block_size": o.block_size, "bf16_stochastic_round":
         o.bf16_stochastic_round, "format": state_format(o)}, indent=1) + "\n")


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


def optim_mismatch(checkpoint: Path, o: OptimConfig) -> Optional[str]:
    """Why this run's optimizer cannot resume from the checkpoint (with the fix), or None."""
    saved = read_optim_meta(checkpoint)
    if state_format(saved) == state_format(o):
        return None
    return (f"{checkpoint} holds the state of optim {state_format(saved)!r}, which optim "
            f"{state_format(o)!r} cannot read: resume with {_overrides(saved, o)}, or start "
            "afresh with resume=none")
