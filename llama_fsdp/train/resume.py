"""A resumed run trains with its config's hyperparameters, not the checkpoint's.

Loading a checkpoint restores the optimizer's param groups (lr, betas, eps, weight decay) and
the scheduler's base rates and last rate: left alone, a run diverged at train.lr=3.0 and resumed
with train.lr=3e-4 would train on at 3.0. After the load the config's values are put back
(``apply``), and each value that differs from the one the checkpoint was trained with is said
in one line (``changes``). The schedule's shape (warm-up, min_lr_ratio, max_steps) is the
config's by construction (the scheduler's function is built from it, never saved); the guard's
thresholds are the config's and its history the checkpoint's (train/divergence.py).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ..config.schema import TrainConfig
from .loop import lr_factor

log = logging.getLogger(__name__)


def record(t: TrainConfig) -> dict[str, Any]:
    """The hyperparameters a checkpoint records (the resolved values, recipes applied)."""
    d = t.divergence
    return {"train.lr": t.lr, "train.warmup_steps": t.warmup_steps,
            "train.min_lr_ratio": t.min_lr_ratio, "train.max_steps": t.max_steps,
            "train.weight_decay": t.weight_decay, "train.beta1": t.beta1,
            "train.beta2": t.beta2, "train.eps": t.eps, "train.max_grad_norm": t.max_grad_norm,
            "train.divergence.action": d.action, "train.divergence.ratio": d.ratio,
            "train.divergence.min_rise": d.min_rise, "train.divergence.window": d.window}


def _shown(v: Any) -> str:
    if isinstance(v, float) and v != 0 and not 1e-3 <= abs(v) < 1e5:
        return f"{v:.1e}"
    return str(v)


def changes(saved: Optional[dict[str, Any]], now: dict[str, Any]) -> list[str]:
    """One line per hyperparameter whose value differs from the checkpoint's."""
    if saved is None:
        return ["resume: the checkpoint records no hyperparameters (written before they were "
                "recorded): the config's values apply"]
    return [f"resume: {k} {_shown(saved[k])} -> {_shown(v)} (the config's value applies)"
            for k, v in now.items() if k in saved and saved[k] != v]


def _set(group: dict[str, Any], key: str, value: Any) -> None:
    """A param group's value; torchao keeps lr as a tensor, changed in place."""
    if isinstance(group.get(key), torch.Tensor):
        group[key].fill_(value)
    else:
        group[key] = value


def apply(optimizer: torch.optim.Optimizer, scheduler: Any, t: TrainConfig) -> None:
    """The config's hyperparameters over what a checkpoint restored: every param group's, the
    scheduler's base rate, and the rate of the next step (on the config's schedule)."""
    factor = lr_factor(scheduler.last_epoch, warmup=t.warmup_steps, max_steps=t.max_steps,
                       min_ratio=t.min_lr_ratio)
    for group in optimizer.param_groups:
        group["initial_lr"] = t.lr
        _set(group, "lr", t.lr * factor)
        group["betas"] = (t.beta1, t.beta2)
        group["eps"], group["weight_decay"] = t.eps, t.weight_decay
    state = scheduler.state_dict()
    n = len(optimizer.param_groups)
    state.update(base_lrs=[t.lr] * n, _last_lr=[t.lr * factor] * n)
    scheduler.load_state_dict(state)


def take_config(app: Any, t: TrainConfig, *, rank: int) -> None:
    """After a resume: the config's hyperparameters apply, and rank 0 says what changed. A
    resume with the hyperparameters it was trained with keeps the restored state untouched: the
    same run resumed continues bit for bit (the values set again, recomputed, may differ from
    the restored ones in the last bit)."""
    now = record(t)
    lines = changes(app.saved_hparams, now)
    if app.saved_hparams is not None and not lines:
        return
    apply(app.optimizer, app.scheduler, t)
    if rank == 0:
        for line in lines:
            log.info("%s", line)
