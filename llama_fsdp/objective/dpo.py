"""Direct Preference Optimization (objective=dpo): the loss, its metrics, and what a rank's run
adds for it (the reference, the batches that carry its log-probs, the held-out metrics).

For a pair (chosen c, rejected r) with summed answer log-probs under the policy (pi) and the
reference (ref), the rewards are ``beta * (pi - ref)`` of each answer and the margin their
difference. The loss per pair (objective.loss):

- sigmoid: ``-(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d)``, d = (pi_c - ref_c) -
  (pi_r - ref_r), e = objective.label_smoothing (0: DPO; > 0: conservative DPO, as torchtune's
  DPOLoss and TRL's earlier sigmoid loss);
- ipo: ``(d' - 1 / (2 beta))^2`` with d' the same difference of log-ratios per answer token,
  as TRL's IPO.

The step's loss is the mean over every pair of the global batch (all ranks, all micro-batches):
each rank's sum over its pairs, divided by the global pair count (train.train_step normalizes
by ``PreferenceLoss.count`` summed over ranks), so a pair's gradient is the same for any world
size and micro-batching. The metrics are means over the same pairs (``METRICS``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import metrics as m
from ..config.objectives import DPO, OBJECTIVES
from ..config.schema import EvalConfig, ObjectiveConfig
from ..model.attention import model_inputs
from ..run.spec import RunSpec
from .dpo_reference import LiveReference, cached_logps, frozen_copy, reshard
from .loss import packed_sequence_logprobs

log = logging.getLogger(__name__)

METRICS, SUMMARY = OBJECTIVES[DPO].metrics, OBJECTIVES[DPO].summary
SIGMOID, IPO = ObjectiveConfig.SIGMOID, ObjectiveConfig.IPO  # objective.loss


def dpo_terms(policy: torch.Tensor, reference: torch.Tensor, cfg: ObjectiveConfig,
              tokens: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per pair: the loss and ``METRICS``, from [2P] sequence log-probs (chosen at even
    positions, rejected at odd ones) of the policy and the reference. ``tokens``: each
    sequence's answer tokens (ipo only)."""
    pc, pr = policy[0::2], policy[1::2]
    ratio_c, ratio_r = pc - reference[0::2], pr - reference[1::2]
    match cfg.loss:
        case ObjectiveConfig.SIGMOID:
            d = cfg.beta * (ratio_c - ratio_r)
            e = cfg.label_smoothing
            losses = -F.logsigmoid(d) * (1 - e) - (F.logsigmoid(-d) * e if e else 0.0)
        case ObjectiveConfig.IPO:
            assert tokens is not None, "ipo normalizes by the answers' tokens"
            d = ratio_c / tokens[0::2].clamp(min=1) - ratio_r / tokens[1::2].clamp(min=1)
            losses = (d - 1 / (2 * cfg.beta)) ** 2
        case _:
            raise ValueError(f"objective.loss={cfg.loss!r} is not one of "
                             f"{', '.join(ObjectiveConfig.LOSSES)}")
    rc, rr = cfg.beta * ratio_c.detach(), cfg.beta * ratio_r.detach()
    metrics = {m.REWARDS_CHOSEN: rc, m.REWARDS_REJECTED: rr, m.REWARDS_MARGIN: rc - rr,
               m.REWARDS_ACCURACY: (rc > rr).float(), m.LOGPS_CHOSEN: pc.detach(),
               m.LOGPS_REJECTED: pr.detach()}
    return losses, metrics


def answer_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[2P] target tokens of each sequence of a batch."""
    seq = batch["target_seq"]
    return torch.zeros(batch["seq_records"].shape[0], device=seq.device).index_add(
        0, seq, torch.ones_like(seq, dtype=torch.float32))


class PreferenceLoss:
    """train.train_step's loss for objective=dpo: summed over this micro-batch's pairs (the
    step divides by the global pair count, ``count``), with ``METRICS`` summed the same way.
    The batch carries the reference's log-probs (``ref_logps``)."""

    def __init__(self, cfg: ObjectiveConfig):
        self.cfg = cfg

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["seq_records"].shape[0] // 2

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor], **_: Any
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(train_step's ``rows`` and ``grad_scale`` are the token loss's: a pair's sequences
        are summed over its own ``target_index``, and the loss is no sum of token terms.)"""
        policy = packed_sequence_logprobs(model, batch)
        tokens = answer_tokens(batch) if self.cfg.loss == IPO else None
        losses, metrics = dpo_terms(policy, batch["ref_logps"], self.cfg, tokens)
        return losses.sum(), {k: v.sum() for k, v in metrics.items()}


@dataclass
class Preference:
    """What objective=dpo adds to a rank's run (worker.RankRun): the loss, the batches with the
    reference's log-probs, and the held-out metrics."""

    cfg: ObjectiveConfig
    loss: PreferenceLoss
    reference: Optional[LiveReference]  # None: cached, the batches carry the log-probs
    device: torch.device

    def batches(self, it: Iterator[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        """The training micro-batches, each with its reference log-probs (a no_grad forward of
        the reference per micro-batch, or the cached values already there)."""
        for batch in it:
            yield batch if self.reference is None else self.reference.attach(batch)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: Any, ev: EvalConfig) -> dict[str, float]:
        """DPO loss and ``METRICS`` over every rank's held-out pairs ("eval_" names), and the
        exact match of greedy answers to the held-out prompts against the chosen answers."""
        sums = torch.zeros(2 + len(METRICS), dtype=torch.float64, device=self.device)
        was_training = model.training
        model.eval()
        try:
            for batch in self.batches(iter(data.eval_batches(ev.max_batches))):
                inputs = model_inputs(model, batch, self.device)
                losses, metrics = dpo_terms(
                    packed_sequence_logprobs(model, inputs), inputs["ref_logps"], self.cfg,
                    answer_tokens(inputs) if self.cfg.loss == IPO else None)
                sums += torch.stack([losses.sum(), *(metrics[k].sum() for k in METRICS),
                                     torch.tensor(float(len(losses)), device=self.device)]).double()
        finally:
            model.train(was_training)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        values = (sums[:-1] / sums[-1].clamp(min=1)).tolist()
        out = {m.EVAL_LOSS: values[0],
               **{m.EVAL_PREFIX + k: v for k, v in zip(METRICS, values[1:])}}
        if ev.task_prompts:
            out.update(self._exact_match(model, data, ev.task_prompts, ev.max_new_tokens))
        return out

    def _exact_match(self, model: nn.Module, data: Any, prompts: int,
                     max_new_tokens: Optional[int]) -> dict[str, float]:
        from ..data.preference import ChosenView
        from .sft import exact_match

        chosen = SimpleNamespace(tokenizer=data.tokenizer, micro_batch=data.micro_batch,
                                 dp_rank=data.dp_rank, dp_world=data.dp_world,
                                 eval=SimpleNamespace(store=ChosenView(data.eval.store)))
        with torch.compiler.set_stance("force_eager"):
            scores = exact_match(model, chosen, device=self.device, max_prompts=prompts,
                                 max_new_tokens=max_new_tokens)
        return {m.EVAL_PREFIX + k: v for k, v in scores.items()}

    @staticmethod
    def summary(logged: list[dict[str, float]], final: dict[str, float]) -> dict[str, float]:
        """The runs table's DPO columns: the last logged value of each (``SUMMARY``)."""
        last = {**(logged[-1] if logged else {}), **final}
        return {name: float(last[key]) for name, key in SUMMARY.items() if key in last}


def build(spec: RunSpec, model: nn.Module, data: Any, device: torch.device, *, rank: int,
          world: int, resuming: bool) -> Preference:
    """The reference of this run (dpo_reference.py), before the policy trains or its checkpoint is
    loaded: with objective.reference=cached, the data's splits get the cached log-probs (made
    now, collectively, if the cache has none)."""
    cfg, adapters = spec.objective, spec.finetune.adapters
    if cfg.reference == ObjectiveConfig.MODEL:
        ref_model = model if adapters else frozen_copy(spec, model, device)
        return Preference(cfg, PreferenceLoss(cfg),
                          LiveReference(ref_model, adapters_off=adapters, device=device), device)

    def reference_now() -> Callable[[dict], torch.Tensor]:
        # the policy's weights are the reference's until it trains, unless a checkpoint will
        # replace them (full fine-tuning resumed): then a frozen copy, for the computation only
        live = model if adapters or not resuming else frozen_copy(spec, model, device)
        return LiveReference(live, adapters_off=adapters, device=device).logps

    path = cached_logps(spec, data, reference_now, rank=rank, world=world, device=device)
    reshard(model)  # before the optimizer is built: it must hold the sharded parameters
    if rank == 0:
        log.info("reference log-probs from %s", path)
    return Preference(cfg, PreferenceLoss(cfg), None, device)

