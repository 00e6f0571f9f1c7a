"""The sharding strategies: one table that config, spec, plan, parallel and the CLI read.

Each strategy maps onto FSDP2 (or composable DDP) as torchtitan does it:

| strategy         | ZeRO | mesh                         | reshard after forward |
|------------------|------|------------------------------|-----------------------|
| full             | 3    | (shard = world)              | yes                   |
| grad_op          | 2    | (shard = world)              | no                    |
| no_shard         | DDP  | (replicate = world)          | (nothing is sharded)  |
| hybrid           | 3    | (replicate, shard = a group) | yes                   |
| hybrid_grad_op   | 2    | (replicate, shard = a group) | no                    |

``auto`` is not a strategy of its own: the planner picks the one with the least communication
that fits (``AUTO_ORDER``). No torch here: the spec and the planner are pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

AUTO = "auto"
# sharding=no_shard's DDP gradient bucket: fewer, larger all-reduces than DDP's 25 MB default
# (torchtitan's choice); the planner counts one bucket in flight.
DDP_BUCKET_MB = 100


@dataclass(frozen=True)
class Strategy:
    name: str
    hybrid: bool  # shard within groups of sharding.shard_size ranks, replicate across them
    reshard_after_forward: bool  # ZeRO-3 (True) or ZeRO-2 (False)
    ddp: bool = False  # a full replica per rank, gradients all-reduced (no_shard)
    # what the strategy is with one shard group of all ranks (hybrid with nothing to replicate)
    one_group: Optional[str] = None


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("full", hybrid=False, reshard_after_forward=True),
    Strategy("grad_op", hybrid=False, reshard_after_forward=False),
    Strategy("no_shard", hybrid=False, reshard_after_forward=False, ddp=True),
    Strategy("hybrid", hybrid=True, reshard_after_forward=True, one_group="full"),
    Strategy("hybrid_grad_op", hybrid=True, reshard_after_forward=False, one_group="grad_op"),
)}
# sharding.strategy values: the strategies, and auto
CHOICES = (*STRATEGIES, AUTO)
# sharding=auto tries these in order: least communication first.
AUTO_ORDER = ("no_shard", "hybrid_grad_op", "hybrid", "grad_op", "full")
LEAST_MEMORY = "full"  # the planner's first fix, and auto's choice when nothing fits


@dataclass(frozen=True)
class MeshSpec:
    """Data-parallel layout: ``replicate`` groups of ``shard`` ranks each.

    ``ddp``: sharding=no_shard, a full replica on every rank whose gradients are all-reduced in
    buckets during backward (composable DDP, as torchtitan does), not FSDP2 on a (world, 1) mesh,
    which pays size-1 all-gathers and reduce-scatters and a second copy of every parameter.
    """

    replicate: int
    shard: int
    reshard_after_forward: bool
    ddp: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.shard,) if self.replicate == 1 else (self.replicate, self.shard)

    @property
    def dim_names(self) -> tuple[str, ...]:
        return ("shard",) if self.replicate == 1 else ("replicate", "shard")


def mesh_for(strategy: str, shard_size: Optional[int], world: int, nproc: int) -> MeshSpec:
    """Map a strategy to (replicate, shard): full / grad_op shard over every rank (replicate 1);
    hybrid / hybrid_grad_op shard within sharding.shard_size ranks (default: a node) and replicate
    across the groups; no_shard replicates over every rank (shard 1). A shard size the strategy
    cannot take gives the flat mesh (run/checks.py's check_mesh says what is wrong)."""
    s = STRATEGIES.get(strategy)
    if s is None:  # auto plans as full until it is chosen
        return MeshSpec(1, world, True)
    if s.ddp:
        return MeshSpec(world, 1, False, ddp=True)
    shard = shard_size if s.hybrid and shard_size is not None else nproc if s.hybrid else world
    if not s.hybrid or shard < 1 or world % shard:
        return MeshSpec(1, world, s.reshard_after_forward)
    return MeshSpec(world // shard, shard, s.reshard_after_forward)


def one_group_warning(strategy: str, mesh: MeshSpec, world: int) -> Optional[str]:
    """A hybrid strategy whose one shard group holds every rank is its flat twin: say so."""
    s = STRATEGIES.get(strategy)
    if s is None or not s.hybrid or mesh.replicate != 1 or world <= 1:
        return None
    return (f"sharding={strategy} with one shard group of all {world} ranks (sharding.shard_size "
            f"defaults to a node's ranks) is sharding={s.one_group}: set sharding.shard_size to "
            f"a divisor of {world} to shard within groups and replicate across them")
