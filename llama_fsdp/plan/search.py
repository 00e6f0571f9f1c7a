"""Searches over plans: the fewest nodes that fit, and ``sharding=auto``'s strategy."""
from __future__ import annotations

import logging
from typing import Optional

from ..run.spec import ConfigError, RunSpec
from ..config.strategies import AUTO, AUTO_ORDER, LEAST_MEMORY, STRATEGIES
from .device import GB
from .fit import make_plan
from .variants import or_none, with_nodes, with_strategy

log = logging.getLogger("llama_fsdp.plan")


def nodes_needed(spec: RunSpec, *, max_nodes: int = 1024) -> Optional[int]:
    """Fewest nodes above spec.nodes (same ranks per node) where it fits fully sharded."""
    base = or_none(lambda: with_strategy(spec, LEAST_MEMORY))
    if base is None:
        return None
    for nodes in range(spec.nodes + 1, max_nodes + 1):
        more = or_none(lambda: with_nodes(base, nodes))
        if more is not None and make_plan(more).fits:
            return nodes
    return None


def _candidates(spec: RunSpec) -> list[str]:
    multi = spec.nodes > 1 or spec.sharding.shard_size is not None
    return [s for s in AUTO_ORDER if not STRATEGIES[s].hybrid or multi]


def choose_strategy(spec: RunSpec) -> tuple[str, str]:
    """For sharding=auto: the least-communication strategy that fits, and why."""
    tried = []
    for strategy in _candidates(spec):
        try:
            plan = make_plan(with_strategy(spec, strategy))
        except ConfigError:  # e.g. no_shard with cpu_offload, NF4 shapes over the shard group
            continue
        if plan.fits:
            skipped = "; ".join(tried)
            return strategy, (f"{strategy}: {plan.predicted_peak_gb:.1f} GB of "
                              f"{plan.usable_bytes / GB:.1f} GB usable per device"
                              + (f" (did not fit: {skipped})" if skipped else ""))
        tried.append(f"{strategy} {plan.predicted_peak_gb:.1f} GB")
    return LEAST_MEMORY, (f"{LEAST_MEMORY}: nothing fits ({'; '.join(tried)}); {LEAST_MEMORY} "
                          "needs the least memory")


def auto_hint(spec: RunSpec, asked: str) -> Optional[str]:
    """For a strategy the user named (``asked``, not auto): what sharding=auto would pick
    instead, when it fits and communicates less (on one machine a small model's replicas:
    benchmarks/real_model.md: a 135M LoRA step on 2 CPU ranks 7.59 s sharded, 4.90 s replicated);
    None when auto would pick the same or nothing fits."""
    if asked == AUTO:
        return None
    strategy, reason = choose_strategy(spec)  # (nothing fits: full, the last of AUTO_ORDER)
    if AUTO_ORDER.index(strategy) >= AUTO_ORDER.index(spec.strategy):
        return None
    return (f"sharding={spec.strategy}: sharding=auto would pick {reason}, with less "
            f"communication")


def resolve_auto(spec: RunSpec) -> RunSpec:
    """Replace sharding=auto by the chosen strategy (other specs are returned unchanged)."""
    if spec.strategy != AUTO:
        return spec
    strategy, reason = choose_strategy(spec)
    log.info("sharding=auto -> %s", reason)
    return with_strategy(spec, strategy)
