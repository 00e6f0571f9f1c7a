"""The training loop: micro-steps x grad_accum -> clip -> AdamW -> LR schedule.

The loss is normalized by the global number of target tokens in the step (all ranks, all
micro-batches), so N ranks with the same global batch compute exactly the 1-rank gradient,
whatever the share of masked tokens on each rank.

A step needs no host sync: the target count is all-reduced on the device and divides the loss
as a tensor; the loss, gradient norm, peak memory and stop requests are reduced together, in
one collective, only at log steps (``train.log_every``), where throughput is measured over the
steps since the previous log step. On CUDA that reduction is read one step late: the gather is
queued behind the log step, and its result is read after the next step has been queued, so the
GPU is never left idle while the host logs (the default logs every step). On CUDA a window's
time is the device's, between two events queued behind the log steps (``_Window``); on the CPU
it is the host's clock.
"""
from __future__ import annotations

import logging
import math
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.state import TrainState
from ..config import metrics as m
from ..config.schema import DivergenceConfig, EvalConfig, TrainConfig
from ..model.attention import model_inputs
from ..model.parallelize import clip_grad_norm, uses_ddp
from ..objective.loss import target_rows
from ..objective.sft import TOKEN_LOSS, TokenLoss
from .divergence import DivergenceGuard

log = logging.getLogger(__name__)


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


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@dataclass
class StepResult:
    """One optimizer step, as device tensors (reading them is a host sync: at log steps only)."""

    loss: torch.Tensor  # this rank's share of the global token-mean loss
    grad_norm: torch.Tensor  # global (all shards)
    tokens: int  # input tokens processed by all ranks (known from the batch shapes)
    # the objective's metrics, each this rank's share of the global mean (as ``loss``)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler,
               micro_batches: list[dict[str, torch.Tensor]], *, device: torch.device,
               max_grad_norm: float, loss_fn: TokenLoss = TOKEN_LOSS) -> StepResult:
    """One optimizer step over this rank's micro-batches; the loss is the global mean over
    ``loss_fn``'s units (target tokens; a DPO run's pairs)."""
    world = _world()
    # torch.full, not torch.tensor(..., device=cuda): a fill kernel, where a host-to-device
    # copy of a pageable scalar would synchronize the stream every step
    targets = torch.full((), float(sum(loss_fn.count(b) for b in micro_batches)),
                         device=device)
    if world > 1:
        dist.all_reduce(targets)
    targets = targets.clamp(min=1.0)  # a step without targets (prepare refuses such data)
    total = torch.zeros((), device=device)
    extras: dict[str, torch.Tensor] = {}
    ddp = uses_ddp(model)
    defer_sync = ddp and len(micro_batches) > 1
    for i, batch in enumerate(micro_batches):
        if defer_sync:  # DDP: all-reduce once, in the last micro-batch's backward
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        rows = target_rows(batch["labels"], device)  # from the host's labels: no sync
        batch = model_inputs(model, batch, device)
        # FSDP and DDP average gradients over ranks: scale by world to get sum / global targets.
        summed, metrics = loss_fn(model, batch, rows=rows, grad_scale=world / targets)
        loss = summed / targets
        (loss * world).backward()
        total += loss.detach()
        for k, v in metrics.items():
            extras[k] = extras.get(k, 0) + v.detach() / targets
    grad_norm = clip_grad_norm([p for p in model.parameters()], max_grad_norm)
    optimizer.step()
    # DDP's gradients are views into its all-reduce buckets: zeroed in place, they stay there
    # (set to None, autograd would make a second set beside the buckets every step)
    optimizer.zero_grad(set_to_none=not ddp)
    scheduler.step()
    tokens = sum(b["input_ids"].numel() for b in micro_batches) * world  # same shape everywhere
    return StepResult(loss=total, grad_norm=grad_norm, tokens=tokens, extras=extras)


class MemoryMeter:
    """Peak memory of this process since ``reset``: CUDA max allocated / reserved (reset after
    the model and optimizer exist, so it is the training steps' peak), or peak RSS on CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def read_gb(self) -> dict[str, float]:
        if self.device.type == "cuda":
            return {m.PEAK_MEMORY: torch.cuda.max_memory_allocated(self.device) / 1e9,
                    m.PEAK_MEMORY_RESERVED: torch.cuda.max_memory_reserved(self.device) / 1e9}
        rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {m.PEAK_MEMORY: rss_kb * 1024 / 1e9}


class StopRequested(Exception):
    """Raised on every rank at a log step after a stop was requested (and the checkpoint saved);
    on CUDA, where a log step is read after the next step is queued, at the step after it."""

    def __init__(self, reason: str, step: int):
        super().__init__(f"{reason} at step {step}")
        self.reason, self.step = reason, step


@dataclass
class LoopContext:
    """What the loop needs besides the model: kept explicit (and each piece replaceable)."""

    device: torch.device
    train: TrainConfig
    eval: EvalConfig
    batches: Iterator[dict[str, torch.Tensor]]
    tracker: Any
    console: Any
    flops_per_token: Optional[float] = None
    peak_flops: Optional[float] = None
    # Called on every rank after every step (checkpoints, user callbacks), in order.
    on_step_end: list[Callable[["TrainState"], None]] = field(default_factory=list)
    # Eval loss and task metrics at a step (collective); None: no evaluation.
    evaluate: Optional[Callable[[int], dict[str, float]]] = None
    # Called on every rank after each eval with its step and the metrics (a search's pruning,
    # train/pruning.py: may raise to stop every rank there).
    on_eval: Optional[Callable[[int, dict[str, float]], None]] = None
    # This rank's pending stop request (0 none, else a code the handler understands); agreed
    # across ranks at log steps (read one step later on CUDA) and handed to on_stop, which
    # saves and raises.
    stop_request: Callable[[], int] = lambda: 0
    on_stop: Optional[Callable[[int, "TrainState"], None]] = None
    # Called once after the first step (e.g. to switch to the training collective timeout).
    after_first_step: Optional[Callable[[], None]] = None
    # Read a log step's reduction after the next step is queued; None: on CUDA, where the host
    # runs ahead of the device (on CPU a step is done when it returns: nothing to overlap). An
    # injection point: tests/multirank/test_log_reads.py forces it on gloo ranks to run the
    # CUDA path's bookkeeping where CI can.
    defer_log_reads: Optional[bool] = None
    # Steps whose reduction is read before the step-end hooks even so: a checkpoint is saved
    # there, and a non-finite loss must stop the run before it is published.
    saves_at: Callable[[int], bool] = lambda step: False
    # What a step minimizes: SFT's token loss, or an objective's (dpo.PreferenceLoss).
    loss_fn: TokenLoss = TOKEN_LOSS
    # Reads every log step's loss and stops a run whose loss runs away (train.divergence);
    # None: only a loss that is not a number stops it.
    guard: Optional[DivergenceGuard] = None


@dataclass
class _Window:
    """The steps since the last log step: their tokens, and their wall time without the eval
    and step-end hooks (checkpoint saves) in between.

    On CUDA the time is the device's: an event recorded when the window opens (queued behind
    the previous log step's work) and one behind the log step's own (``_LogReduce.start``), so
    a host that blocks while it queues a step (pinned-memory allocations of
    checkpointing.offload, which synchronize) does not move the step's work into the window
    before it. The first CUDA run of 8B QLoRA at 65,536 tokens with offloaded activations
    timed its last step at 2.4 ms (27.6M tokens/s) from the host clock."""

    start: float
    steps: int = 0
    tokens: int = 0
    excluded: float = 0.0
    begun: Any = None  # CUDA: the event at the window's start; None: the host clock
    ended: Any = None  # CUDA: the event behind the log step's work

    @classmethod
    def open(cls, device: torch.device, start: Optional[float] = None) -> "_Window":
        return cls(time.perf_counter() if start is None else start, begun=_event(device))

    def seconds(self, now: float) -> float:
        """The window's time without what ``excluded`` holds."""
        if self.begun is not None and self.ended is not None:
            total = self.begun.elapsed_time(self.ended) / 1000.0  # both done: the read synced
        else:
            total = now - self.start
        return max(total - self.excluded, 1e-9)


def _event(device: torch.device) -> Any:
    """A timing event recorded on the current CUDA stream (None off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


@dataclass
class _LogReduce:
    """A log step's reduction, queued: one all-gather of a small vector, read (one host sync)
    by ``result``, at once or after the next step was queued."""

    step: int
    lr: float
    window: _Window
    keys: list[str]
    rows: list[torch.Tensor]
    work: Any = None
    extra_keys: tuple[str, ...] = ()  # the objective's metrics, summed over ranks as the loss

    @classmethod
    def start(cls, res: StepResult, meter: MemoryMeter, stop: int, device: torch.device, *,
              step: int, lr: float, window: _Window) -> "_LogReduce":
        mem = meter.read_gb()  # CUDA's counters are host-side: no sync
        window.ended = _event(device)  # behind the step's work, before the reduction
        # host values as fill kernels (no synchronizing copy); the gradient norm is on the CPU
        # when sharding.cpu_offload keeps the gradients there
        extra = tuple(res.extras)
        local = torch.stack([res.loss.to(device, torch.float64),
                             *[res.extras[k].to(device, torch.float64) for k in extra],
                             res.grad_norm.reshape(()).to(device, torch.float64),
                             *[torch.full((), v, device=device, dtype=torch.float64)
                               for v in [*mem.values(), float(stop)]]])
        world = _world()
        if world == 1:
            return cls(step, lr, window, list(mem), [local], extra_keys=extra)
        rows = [torch.empty_like(local) for _ in range(world)]
        return cls(step, lr, window, list(mem), rows, dist.all_gather(rows, local, async_op=True),
                   extra_keys=extra)

    def result(self) -> tuple[float, float, dict[str, float], int, dict[str, float]]:
        """(global loss, grad norm, max peak memory over ranks, agreed stop request, the
        objective's global metrics)."""
        if self.work is not None:
            self.work.wait()
        stacked = torch.stack(self.rows)
        k = 1 + len(self.extra_keys)  # summed over ranks
        vals = torch.cat([stacked[:, :k].sum(0), stacked[0, k:k + 1],
                          stacked[:, k + 1:].max(0).values]).tolist()
        return (vals[0], vals[k], dict(zip(self.keys, vals[k + 1:-1])), int(vals[-1]),
                dict(zip(self.extra_keys, vals[1:k])))


def step_metrics(*, loss: float, grad_norm: float, lr: float, window: _Window, now: float,
                 world: int, mem: dict[str, float], flops_per_token: Optional[float],
                 peak_flops: Optional[float]) -> dict[str, float]:
    dt = window.seconds(now)
    tps = window.tokens / dt
    out = {m.LOSS: loss, m.LR: lr, m.GRAD_NORM: grad_norm, m.TOKENS_PER_SEC: tps,
           m.TOKENS_PER_SEC_PER_DEVICE: tps / world, m.STEP_TIME: dt / max(window.steps, 1),
           **mem}
    if flops_per_token and peak_flops:
        out[m.MFU] = flops_per_token * (tps / world) / peak_flops
    return out


@dataclass
class LoopResult:
    last: dict[str, float]  # the last logged step's metrics, with the last eval's
    logged: list[dict[str, float]]  # every log step's metrics, with "step"


def steady_median(logged: list[dict[str, float]], key: str, *,
                  skip_fraction: float = 0.1) -> Optional[float]:
    """Median of a per-log-step metric after warm-up: the first log step (compilation, caches,
    allocator growth) and the first ``skip_fraction`` of the steps are left out."""
    import statistics

    if not logged:
        return None
    first, last = logged[0]["step"], logged[-1]["step"]
    cut = first + skip_fraction * (last - first)
    vals = [row[key] for row in logged[1:] if row["step"] >= cut and key in row] or \
        [row[key] for row in logged if key in row]
    return statistics.median(vals) if vals else None


def run_loop(model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, state: TrainState,
             ctx: LoopContext) -> LoopResult:
    """Train from state.step to train.max_steps (or stop_after)."""
    t, world = ctx.train, _world()
    meter, last, logged = MemoryMeter(ctx.device), {}, []
    defer = ctx.device.type == "cuda" if ctx.defer_log_reads is None else ctx.defer_log_reads
    model.train()
    if ctx.evaluate is not None and ctx.eval.every_steps and state.step == 0:
        _run_eval(ctx, 0, last)  # the baseline the eval curve falls from
    meter.reset()
    end = t.max_steps if t.stop_after is None else min(t.max_steps, t.stop_after)
    window, first = _Window.open(ctx.device), True
    pending: Optional[_LogReduce] = None

    def finish(reduce: _LogReduce) -> tuple[float, int]:
        """Read and log a log step's reduction; return when its result arrived (the next
        window's start) and the stop request the ranks agreed on."""
        nonlocal last
        loss, grad_norm, mem, stop, extras = reduce.result()
        now = time.perf_counter()
        guard = ctx.guard or DivergenceGuard(DivergenceConfig(action="off"))
        if not math.isfinite(loss):
            # raises: a loss that is no number is not logged
            guard.observe(reduce.step, loss, reduce.lr)
        state.losses.append(loss)
        last = {**{k: v for k, v in last.items() if k.startswith(m.EVAL_PREFIX)},
                **step_metrics(loss=loss, grad_norm=grad_norm, lr=reduce.lr, window=reduce.window,
                               now=now, world=world, mem=mem,
                               flops_per_token=ctx.flops_per_token, peak_flops=ctx.peak_flops),
                **extras}
        step_only = {k: v for k, v in last.items() if not k.startswith(m.EVAL_PREFIX)}
        logged.append({"step": reduce.step, **step_only})
        ctx.tracker.log_metrics(step_only, step=reduce.step)
        ctx.console.update(reduce.step, last)
        # (logged first: the chart shows where it ran away)
        guard.observe(reduce.step, loss, reduce.lr)
        return now, stop

    while state.step < end:
        micro = [next(ctx.batches) for _ in range(t.grad_accum)]
        lr = float(scheduler.get_last_lr()[0])  # a 0-d tensor for torchao's optimizers
        res = train_step(model, optimizer, scheduler, micro, device=ctx.device,
                         max_grad_norm=t.max_grad_norm, loss_fn=ctx.loss_fn)
        state.step += 1
        state.tokens_seen += res.tokens
        stop = 0
        if pending is not None:  # the previous log step's, read now that this step is queued
            reduce, pending = pending, None
            window.start, stop = finish(reduce)  # this window began when that step was done
        window.steps, window.tokens = window.steps + 1, window.tokens + res.tokens
        if stop or state.step % t.log_every == 0 or state.step == end:
            reduce = _LogReduce.start(res, meter, ctx.stop_request(), ctx.device,
                                      step=state.step, lr=lr, window=window)
            eval_due = bool(ctx.evaluate is not None and ctx.eval.every_steps
                            and state.step % ctx.eval.every_steps == 0)  # it syncs anyway
            # read now at the last step, before an eval or a save, and before a stop's save: a
            # non-finite loss must end the run before its weights are published
            if (defer and not stop and state.step < end and not eval_due
                    and not ctx.saves_at(state.step)):
                # the host clock's start is set at the read; CUDA's event is queued here
                pending, window = reduce, _Window.open(ctx.device)
            else:
                now, agreed = finish(reduce)
                window, stop = _Window.open(ctx.device, now), max(stop, agreed)
        if stop and ctx.on_stop is not None:
            ctx.on_stop(stop, state)  # saves, then raises StopRequested on every rank
        paused = time.perf_counter()
        if first and ctx.after_first_step is not None:
            ctx.after_first_step()
        first = False
        if ctx.evaluate is not None and ctx.eval.every_steps and (
                state.step % ctx.eval.every_steps == 0 or state.step == end):
            _run_eval(ctx, state.step, last)
        for hook in ctx.on_step_end:
            hook(state)
        # eval and saves are not training time; with a read pending the GPU was still busy
        # with the step while the hooks ran, so their time stays in that step's window
        if pending is None:
            window.excluded += time.perf_counter() - paused
    return LoopResult(last=last, logged=logged)


def _run_eval(ctx: LoopContext, step: int, last: dict[str, float]) -> None:
    t0 = time.perf_counter()
    metrics = ctx.evaluate(step)  # type: ignore[misc]
    metrics[m.EVAL_TIME] = time.perf_counter() - t0
    ctx.tracker.log_metrics(metrics, step=step)
    ctx.console.info("step %d: %s", step, ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
    last.update(metrics)
    if ctx.on_eval is not None:
        ctx.on_eval(step, metrics)
