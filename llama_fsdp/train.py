"""The training loop: micro-steps x grad_accum -> clip -> AdamW -> LR schedule.

The loss is normalized by the global number of target tokens in the step (all ranks, all
micro-batches), so N ranks with the same global batch compute exactly the 1-rank gradient,
whatever the share of masked tokens on each rank.
"""
from __future__ import annotations

import logging
import math
import os
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import EvalConfig, TrainConfig
from .parallel import clip_grad_norm

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Counters a checkpoint must carry to continue a run exactly."""

    step: int = 0
    tokens_seen: int = 0
    losses: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])


def build_optimizer(model: nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                             weight_decay=t.weight_decay, foreach=True)


def lr_factor(step: int, *, warmup: int, max_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_ratio at max_steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, t: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, warmup=t.warmup_steps, max_steps=t.max_steps,
                                 min_ratio=t.min_lr_ratio))


def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token cross-entropy over the batch's target tokens (fp32)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                           ignore_index=-100, reduction="sum")


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op=op)
    return t


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    tokens: int  # input tokens processed by all ranks


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler,
               micro_batches: list[dict[str, torch.Tensor]], *, device: torch.device,
               max_grad_norm: float) -> StepResult:
    """One optimizer step over this rank's micro-batches; the loss is the global token mean."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    counts = torch.tensor([float(sum(int((b["labels"] != -100).sum()) for b in micro_batches)),
                           float(sum(b["input_ids"].numel() for b in micro_batches))], device=device)
    targets, tokens = _all_reduce(counts).tolist()
    if targets == 0:
        raise RuntimeError("a training step has no target tokens on any rank (all labels -100)")
    total = torch.zeros((), device=device)
    for batch in micro_batches:
        batch = _to(batch, device)
        # FSDP averages gradients over ranks, so scale by world to get sum / global targets.
        loss = loss_sum(model, batch) / targets
        (loss * world).backward()
        total += loss.detach()
    grad_norm = clip_grad_norm([p for p in model.parameters()], max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return StepResult(loss=_all_reduce(total).item(), grad_norm=float(grad_norm),
                      tokens=int(tokens))


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[dict[str, torch.Tensor]], *,
             device: torch.device) -> float:
    """Token-mean eval loss over every rank's held-out batches."""
    n = _all_reduce(torch.tensor(len(batches), device=device), dist.ReduceOp.MIN).item()
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, device=device)
    for batch in batches[: int(n)]:  # every rank runs the same number of forwards (FSDP)
        batch = _to(batch, device)
        sums[0] += loss_sum(model, batch)
        sums[1] += (batch["labels"] != -100).sum()
    model.train(was_training)
    s, c = _all_reduce(sums).tolist()
    return s / max(c, 1.0)


def inject_fault(step: int) -> None:
    """Testing hook: LLAMA_FSDP_FAULT="rank=R,step=S" makes rank R raise after step S.

    The launcher tests use it to show that one rank's crash ends the whole run with that
    rank's traceback instead of a hang.
    """
    spec = os.environ.get("LLAMA_FSDP_FAULT")
    if not spec:
        return
    want = dict(kv.split("=") for kv in spec.split(","))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if int(want["rank"]) == rank and int(want["step"]) == step:
        raise RuntimeError(f"injected fault on rank {rank} after step {step} (LLAMA_FSDP_FAULT)")


class MemoryMeter:
    """Peak memory of this process: CUDA max allocated/reserved, or peak RSS on CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def read_gb(self) -> dict[str, float]:
        if self.device.type == "cuda":
            return {"peak_memory_gb": torch.cuda.max_memory_allocated(self.device) / 1e9,
                    "peak_memory_reserved_gb": torch.cuda.max_memory_reserved(self.device) / 1e9}
        rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"peak_memory_gb": rss_kb * 1024 / 1e9}

    def global_peak(self) -> dict[str, float]:
        local = self.read_gb()
        t = torch.tensor(list(local.values()), device=self.device, dtype=torch.float64)
        _all_reduce(t, dist.ReduceOp.MAX)
        return dict(zip(local, t.tolist()))


@dataclass
class LoopContext:
    """What the loop needs besides the model: kept explicit (and each piece replaceable)."""

    device: torch.device
    train: TrainConfig
    eval: EvalConfig
    batches: Iterator[dict[str, torch.Tensor]]
    eval_batches: Callable[[], list[dict[str, torch.Tensor]]]
    tracker: Any
    console: Any
    flops_per_token: Optional[float] = None
    peak_flops: Optional[float] = None
    on_step_end: Optional[Callable[[TrainState], None]] = None
    on_eval: Optional[Callable[[int], dict[str, float]]] = None


def step_metrics(res: StepResult, *, dt: float, lr: float, world: int, mem: dict[str, float],
                 flops_per_token: Optional[float], peak_flops: Optional[float]) -> dict[str, float]:
    tps = res.tokens / dt
    m = {"loss": res.loss, "lr": lr, "grad_norm": res.grad_norm, "tokens_per_sec": tps,
         "tokens_per_sec_per_device": tps / world, "step_time_s": dt, **mem}
    if flops_per_token and peak_flops:
        m["mfu"] = flops_per_token * (tps / world) / peak_flops
    return m


def run_loop(model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, state: TrainState,
             ctx: LoopContext) -> dict[str, float]:
    """Train from state.step to train.max_steps; returns the last step's metrics."""
    t, world = ctx.train, (dist.get_world_size() if dist.is_initialized() else 1)
    meter, last = MemoryMeter(ctx.device), {}
    model.train()
    if ctx.eval.every_steps and state.step == 0:
        _run_eval(model, ctx, 0, last)  # the baseline the eval curve falls from
    while state.step < t.max_steps:
        if t.stop_after is not None and state.step >= t.stop_after:
            break  # a chunk of a longer run: the schedule still ends at max_steps
        micro = [next(ctx.batches) for _ in range(t.grad_accum)]
        lr = scheduler.get_last_lr()[0]
        t0 = time.perf_counter()
        res = train_step(model, optimizer, scheduler, micro, device=ctx.device,
                         max_grad_norm=t.max_grad_norm)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        dt = time.perf_counter() - t0
        state.step += 1
        state.tokens_seen += res.tokens
        inject_fault(state.step)
        state.losses.append(res.loss)
        if not math.isfinite(res.loss):
            raise FloatingPointError(f"loss is {res.loss} at step {state.step}: lower train.lr "
                                     "or use precision=mixed")
        last = step_metrics(res, dt=dt, lr=lr, world=world, mem=meter.global_peak(),
                            flops_per_token=ctx.flops_per_token, peak_flops=ctx.peak_flops)
        if state.step % t.log_every == 0 or state.step == t.max_steps:
            ctx.tracker.log_metrics(last, step=state.step)
        ctx.console.update(state.step, last)
        if ctx.eval.every_steps and (state.step % ctx.eval.every_steps == 0
                                     or state.step == t.max_steps):
            _run_eval(model, ctx, state.step, last)
        if ctx.on_step_end is not None:
            ctx.on_step_end(state)
    return last


def _run_eval(model: nn.Module, ctx: LoopContext, step: int, last: dict[str, float]) -> None:
    metrics = {"eval_loss": evaluate(model, ctx.eval_batches(), device=ctx.device)}
    if ctx.on_eval is not None:
        metrics.update(ctx.on_eval(step))
    ctx.tracker.log_metrics(metrics, step=step)
    ctx.console.info("step %d: %s", step, ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
    last.update(metrics)
