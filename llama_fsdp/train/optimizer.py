"""The optimizer (optim=adamw | adamw8bit | adamw4bit): torch's AdamW (fused on CUDA and the
CPU, foreach elsewhere: optim.fused), or torchao's AdamW with 8- or 4-bit moments, made to hold under FSDP2.

torchao's low-bit AdamW (torchao/optim/adam.py) steps each parameter with a compiled fp32
function and keeps its moments as OptimState8bit / OptimState4bit (codes + block scales). Two
things break under FSDP2 as shipped, and the subclasses here mend them:

- torchao decides low-bit or not from the local shard (at least 4096 elements, whole blocks).
  An uneven dim-0 split can give one parameter low-bit state on some ranks and plain state on
  others; gathers and DCP saves of it then run mismatched collectives (gloo aborts). Here the
  rule must hold for every rank's shard (plan/optimizer.py's lowbit_everywhere, from the
  global shape and the mesh, no collective), so a parameter is low-bit everywhere or nowhere.
- torchao gives the state the parameter's dtype as its "appearance" dtype, but its
  aten.view (used by DTensor.from_local) drops it: with bf16 parameters the local tensor is
  an fp32-looking view of a bf16-looking base and the first compiled step fails
  ("aten.view.dtype"). Here low-bit state always looks fp32 (what torchao computes in; the
  bytes are the same); full-precision fallback state keeps the parameter's dtype.

``eager=True`` runs the step without torch.compile (same numbers, no compile at the start,
slower steps). The compiled step's artifacts are cached per optimizer, block size and shard
layout (``compile_cache_dir``, set by the worker): torch's AOTAutograd cache keys a DTensor
input by its global spec, not its local shard, so ranks with different shards, or an 8-bit and
a 4-bit run of one model, must not share a cache directory (pytorch/pytorch#188390). Ranks
whose shards look alike do share one, and the first of them to step compiles while the others
wait, then load what it wrote (``compiled_once``): a node compiles the step once, not once per
rank.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..config.schema import OptimConfig, TrainConfig
from ..config.optimizers import OPTIMIZERS
from ..plan.optimizer import lowbit_everywhere, shard_numels

# torchao logs import noise that llama_fsdp.import_noise filters (installed by llama_fsdp/__init__.py)
from torchao.optim import AdamW4bit, AdamW8bit, _AdamW  # noqa: E402
from torchao.optim.subclass_4bit import OptimState4bit  # noqa: E402
from torchao.optim.subclass_8bit import OptimState8bit  # noqa: E402

LOWBIT_STATES = (OptimState8bit, OptimState4bit)

log = logging.getLogger(__name__)


def local_numels(p: torch.Tensor) -> list[int]:
    """The distinct local element counts of a parameter's shards over its mesh ([numel] for
    a plain tensor): FSDP2 shards dim 0 (Shard(0)) over one mesh dim and replicates over the
    other, like torch.chunk, which plan/optimizer.py's shard_numels counts."""
    if not isinstance(p, DTensor):
        return [p.numel()]
    shards = [(i, pl) for i, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    if not shards:
        return [p.numel()]
    if len(shards) > 1 or not (isinstance(shards[0][1], Shard) and shards[0][1].dim == 0):
        raise NotImplementedError(f"low-bit AdamW here knows FSDP2's Shard(0) layout, not "
                                  f"{p.placements}")
    return shard_numels(tuple(p.shape), p.device_mesh.size(shards[0][0]))


class _FSDPState:
    """Low-bit state decided for every rank's shard at once, looking fp32 (see the module)."""

    block_size: int
    _state_cls: type

    def _new_buffer(self, p: torch.Tensor, signed: bool):
        local = p.to_local() if isinstance(p, DTensor) else p
        if lowbit_everywhere(local_numels(p), self.block_size):
            out = self._state_cls.zeros(local.shape, signed, self.block_size, local.device,
                                        dtype=torch.float32)
        else:  # torchao's own fallback, on every rank of this parameter
            out = torch.zeros_like(local)
        if isinstance(p, DTensor):
            out = DTensor.from_local(out, device_mesh=p.device_mesh, placements=p.placements,
                                     run_check=False, shape=p.shape, stride=p.stride())
        return out.to(p.device)


class _StepOptions:
    """``eager=True``: the step runs under torch.compiler's force_eager stance.
    ``compile_dir``: the first compiled step runs under ``compiled_once`` there."""

    def __init__(self, *args, eager: bool = False, compile_dir: Optional[Path] = None,
                 **kwargs):
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.eager = eager
        self._first_in = None if eager else compile_dir

    @torch.no_grad()
    def step(self, closure=None):
        if self.eager:
            with torch.compiler.set_stance("force_eager"):
                return super().step(closure)  # type: ignore[misc]
        if self._first_in is not None:
            where, self._first_in = self._first_in, None
            with compiled_once(where):
                return super().step(closure)  # type: ignore[misc]
        return super().step(closure)  # type: ignore[misc]


class AdamW8bitFSDP(_StepOptions, _FSDPState, AdamW8bit):
    _state_cls = OptimState8bit


class AdamW4bitFSDP(_StepOptions, _FSDPState, AdamW4bit):
    _state_cls = OptimState4bit


LOWBIT_OPTIMIZERS = {8: AdamW8bitFSDP, 4: AdamW4bitFSDP}  # by optimizers.Optimizer.moment_bits


class AdamWStochasticRound(_StepOptions, _AdamW):
    """AdamW in fp32 math whose bf16 parameters are written by stochastic rounding (its
    moments stay in the parameters' dtype, as torch's AdamW keeps them)."""


def build_optimizer(model: torch.nn.Module, t: TrainConfig, o: OptimConfig, *,
                    compile_dir: Optional[Path] = None) -> torch.optim.Optimizer:
    """The optimizer ``o`` names, with train's hyperparameters, over what trains: a LoRA model's
    frozen base has no gradients and no optimizer state. ``compile_dir``: the compiled step's
    cache (``compile_cache_dir``), where its first step compiles once for all who share it."""
    params = [p for p in model.parameters() if p.requires_grad]
    hyper = dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay)
    if o.name not in OPTIMIZERS:
        raise ValueError(f"optim.name={o.name!r}: valid: {', '.join(OPTIMIZERS)}")
    if OPTIMIZERS[o.name].lowbit:
        cls = LOWBIT_OPTIMIZERS[OPTIMIZERS[o.name].moment_bits]
        return cls(params, eager=o.eager, compile_dir=compile_dir, block_size=o.block,
                   bf16_stochastic_round=o.bf16_stochastic_round, **hyper)
    if o.bf16_stochastic_round:
        return AdamWStochasticRound(params, eager=o.eager, compile_dir=compile_dir,
                                    bf16_stochastic_round=True, **hyper)
    if o.fused_on(params[0].device.type if params else "cpu"):
        return torch.optim.AdamW(params, fused=True, **hyper)
    return torch.optim.AdamW(params, foreach=True, **hyper)


def shard_layout(model: torch.nn.Module) -> str:
    """A digest of what a compiled step's inputs look like on this rank: each trained
    parameter's global shape, local shard shape, dtype, placements and mesh shape. Ranks with
    the same digest compile the same graphs."""
    h = hashlib.sha256()
    for p in model.parameters():
        if not p.requires_grad:
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        mesh = tuple(p.device_mesh.shape) if isinstance(p, DTensor) else ()
        h.update(repr((tuple(p.shape), tuple(local.shape), str(p.dtype),
                       tuple(getattr(p, "placements", ())), mesh)).encode())
    return h.hexdigest()[:16]


def compile_cache_dir(cache_dir: str | Path, o: OptimConfig, model: torch.nn.Module) -> Path:
    """<cache_dir>/inductor/<name>[-sr]-b<block>/shards-<digest>: one inductor cache per
    optimizer, block size and shard layout (see the module docstring for why ranks with other
    shards may not share it)."""
    tag = f"{o.name}{'-sr' if o.bf16_stochastic_round else ''}-b{o.block}"
    return Path(cache_dir) / "inductor" / tag / f"shards-{shard_layout(model)}"


COMPILED = "compiled"  # a compile_dir's marker: a first step finished there
LOCK = "compile.lock"
LOCK_WAIT_S = 600.0  # a waiter that has waited this long compiles on its own


@contextmanager
def compiled_once(directory: Path, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Around a compiled step's first run: of the processes that share ``directory`` (the
    ranks of a node with one shard layout), the first compiles alone while the others wait,
    then they run at once and load its graphs from the cache instead of compiling them again.

    An flock on ``directory/compile.lock``, held until the first step has finished and
    ``compiled`` is written; a process that finds ``compiled`` runs at once. The lock is only
    an order: a miss still compiles, a holder that dies releases it, and a waiter gives up after
    ``wait_s`` (the step holds no collective, so no rank waits on a waiter)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK, "a") as lock:
        first = _flock(lock, wait_s)
        if not first:
            log.warning("waited %.0f s for another process's first compiled step in %s: "
                        "compiling here too", wait_s, directory)
        elif (directory / COMPILED).exists():  # a first step finished here: run at once
            fcntl.flock(lock, fcntl.LOCK_UN)
            first = False
        yield
        if first:
            (directory / COMPILED).touch()


def _flock(f, wait_s: float) -> bool:
    """An exclusive flock on ``f`` within ``wait_s``: whether it was taken."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)


def use_compile_cache(path: Path) -> None:
    """Point inductor at ``path``. Inductor reads TORCHINDUCTOR_CACHE_DIR when it first
    compiles, so this holds any time before the first step."""
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)


def state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the moments this rank holds, by part: low-bit codes, scales and code tables,
    and full-precision (plain) moments; the step counters apart."""
    out = {"codes": 0, "scales": 0, "qmaps": 0, "plain": 0, "steps": 0}

    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    for state in optimizer.state.values():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            value = value.to_local() if isinstance(value, DTensor) else value
            if key == "step":
                out["steps"] += size(value)
            elif isinstance(value, LOWBIT_STATES):
                out["codes"] += size(value.codes)
                out["scales"] += size(value.scale)
                out["qmaps"] += size(value.qmap)
            else:
                out["plain"] += size(value)
    return out
