"""What the weights train for (``objective=``): one interface, one implementation per objective.

| objective | its step loss                                | its batches                  | held out                         |
|-----------|----------------------------------------------|------------------------------|----------------------------------|
| sft       | cross-entropy on the answers' tokens (sft.py) | the data's rows              | eval loss, exact match           |
| dpo       | DPO / IPO on preference pairs (dpo.py)        | pairs, with the reference's log-probs (dpo_reference.py) | eval loss, reward accuracy and margin, exact match on the chosen answers |

``build_objective`` returns the run's ``Objective``; the worker (train/worker.py) trains and
evaluates through its methods and never asks which objective it is:

- ``loss``: the step's loss (``count(batch)``: the units the step's loss is a mean over, target
  tokens or pairs; ``loss(model, batch, rows=, grad_scale=)``: their summed loss and the
  objective's own metrics, summed the same way);
- ``batches(it)``: the training micro-batches as the loss takes them;
- ``evaluate(model, data, eval_cfg)``: the held-out numbers ("eval_" names; collective);
- ``summary(logged, final)``: the objective's own summary/* numbers at the end.

Both objectives compute through the chunked loss head (loss.py), which never holds the logits.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol

from ..config.objectives import DPO, SFT
from ..config.schema import EvalConfig


class Objective(Protocol):
    loss: Any

    def batches(self, it: Iterator[dict]) -> Iterator[dict]: ...

    def evaluate(self, model: Any, data: Any, ev: EvalConfig) -> dict[str, float]: ...

    def summary(self, logged: list[dict[str, float]],
                final: dict[str, float]) -> dict[str, float]: ...


def _builder(name: str) -> Callable[..., Objective]:
    if name == SFT:
        from .sft import build
    elif name == DPO:
        from .dpo import build
    else:
        raise ValueError(f"objective={name!r} has no implementation")
    return build


def build_objective(spec: Any, model: Any, data: Any, device: Any, *, rank: int, world: int,
                    resuming: bool) -> Objective:
    """The run's objective on this rank, built before the policy trains or its checkpoint is
    loaded (DPO's reference is the weights as they start). Collective where the objective's
    preparation is (a cached reference's log-probs)."""
    return _builder(spec.objective.name)(spec, model, data, device, rank=rank, world=world,
                                         resuming=resuming)
