"""What the in-run eval costs, in steps of training, once the data is known (prepare/job.py
states it before any rank starts; docs/evaluate.md).

Work is counted in token-forwards per rank: a training step is a forward and a backward (3
forwards' worth; 2 under adapters, whose backward computes no weight gradient of the base) of
``grad_accum`` micro-batches; the held-out loss is a forward of each
held-out micro-batch; exact match is, per chunk of ``train.batch_size`` prompts, one forward
over the prompts and one per new token. A forward of few tokens is not cheaper than one of
``FORWARD_FLOOR_TOKENS``: it reads every weight (and under FSDP gathers it) all the same, which
is what makes token-by-token decoding slow.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..run.spec import RunSpec

# The tokens below which a forward costs as much as one of this many: where reading the weights
# (fp32 on a CPU core's ~10 GB/s, 16-bit on a GPU's HBM) stops being hidden behind the matmuls.
FORWARD_FLOOR_TOKENS = {"cpu": 128, "cuda": 512}
# eval.max_batches=null: the held-out loss over every held-out row while that keeps one eval
# within this many training steps; beyond, the rows that fit (fit_eval says so)
EVAL_BUDGET_STEPS = 1.0


@dataclass(frozen=True)
class EvalCost:
    steps: float  # one eval, in training steps
    loss_batches: int  # held-out micro-batches a rank
    prompts: int  # exact match's prompts (all ranks)
    new_tokens: int  # exact match's bound on new tokens a prompt (0: no exact match)

    def line(self, every: int) -> str:
        what = [f"held-out loss over {self.loss_batches} micro-batch(es) a rank"]
        what.append(f"exact match of {self.prompts} greedy answers of at most "
                    f"{self.new_tokens} tokens" if self.prompts else "no exact match")
        return (f"eval every {every} steps (and at step 0): about {self.steps:.2g} training "
                f"steps each ({'; '.join(what)})")


def eval_cost(spec: RunSpec, stats: dict[str, Any]) -> EvalCost:
    """One eval's cost for the run's data (``stats``: build_data's)."""
    floor = FORWARD_FLOOR_TOKENS.get(spec.device, FORWARD_FLOOR_TOKENS["cuda"])
    b, s, world, ev = spec.train.batch_size, spec.train.seq_len, spec.dp_size, spec.eval

    def forward(tokens: float) -> float:
        return max(tokens, floor)

    step = (2 if spec.finetune.adapters else 3) * spec.train.grad_accum * forward(b * s)
    loss_batches = math.ceil(int(stats.get("eval_rows", 0)) / world / b)
    if ev.max_batches is not None:
        loss_batches = min(loss_batches, ev.max_batches)
    prompts = min(ev.task_prompts or 0, int(stats.get("eval_short_answers", 0)))
    new = ev.max_new_tokens or int(stats.get("eval_short_answer_tokens_max", 0))
    chunks = math.ceil(math.ceil(prompts / world) / b)
    prompt = int(stats.get("eval_prompt_tokens_max", 0))
    work = loss_batches * forward(b * s) + chunks * (forward(b * prompt) + new * forward(b))
    return EvalCost(steps=work / step, loss_batches=loss_batches, prompts=prompts,
                    new_tokens=new if prompts else 0)


def fit_eval(spec: RunSpec, stats: dict[str, Any]) -> tuple[RunSpec, EvalCost, str]:
    """The spec with eval.max_batches set where a null one would let the held-out loss cost
    more than EVAL_BUDGET_STEPS (the rows that fit, one micro-batch at least), its cost, and
    what was left out ("" when nothing)."""
    cost = eval_cost(spec, stats)
    if spec.eval.max_batches is not None or cost.steps <= EVAL_BUDGET_STEPS:
        return spec, cost, ""
    one = eval_cost(dataclasses.replace(spec, eval=dataclasses.replace(
        spec.eval, max_batches=1)), stats)
    per_batch = (cost.steps - one.steps) / max(cost.loss_batches - 1, 1)
    n = max(1, int((EVAL_BUDGET_STEPS - one.steps) / per_batch) + 1) if per_batch else 1
    if n >= cost.loss_batches:
        return spec, cost, ""
    fitted = dataclasses.replace(spec, eval=dataclasses.replace(spec.eval, max_batches=n))
    return fitted, eval_cost(fitted, stats), (
        f"; the loss over {n} of {cost.loss_batches} held-out micro-batches a rank, which keeps "
        f"it within {EVAL_BUDGET_STEPS:g} training step (all of them: about {cost.steps:.2g} "
        "steps; eval.max_batches sets it)")
