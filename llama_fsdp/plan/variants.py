"""What-if variants of a RunSpec: another strategy, node count, optimizer, method or sequence
length, and a spec built without Hydra. Each variant is what build_spec would accept: the
validator's own rules (spec.variant_problems) decide, and a variant they refuse raises
ConfigError (``or_none`` turns that into None)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from ..config.schema import (
    CheckpointingConfig,
    ClusterConfig,
    Config,
    DataConfig,
    PrecisionConfig,
    ShardingConfig,
    TrainConfig,
    model_preset,
)
from ..config import recipes
from ..config.objectives import OBJECTIVES
from ..config.placement import Placement
from ..run.checks import variant_problems
from ..run.spec import ConfigError, RunSpec, build_spec
from ..config.strategies import STRATEGIES, mesh_for


def checked(spec: RunSpec) -> RunSpec:
    """The spec, if the validator accepts it; else ConfigError with its problems."""
    problems = variant_problems(spec)
    if problems:
        raise ConfigError(problems)
    return spec


def or_none(make: Callable[[], Optional[RunSpec]]) -> Optional[RunSpec]:
    """A variant, or None where it is not a valid run (e.g. NF4 shapes over its shard group)."""
    try:
        return make()
    except ConfigError:
        return None


def with_strategy(spec: RunSpec, strategy: str) -> RunSpec:
    """The spec with another sharding strategy and its mesh; raise ConfigError if invalid."""
    shard_size = spec.sharding.shard_size if STRATEGIES[strategy].hybrid else None
    mesh = mesh_for(strategy, shard_size, spec.world_size, spec.nproc_per_node)
    name = spec.run_name
    if spec.tracking.run_name is None:  # the generated name carries the strategy
        name = name.replace(f" shard={spec.strategy} ", f" shard={strategy} ", 1)
    return checked(dataclasses.replace(
        spec, strategy=strategy, mesh=mesh, run_name=name,
        sharding=dataclasses.replace(spec.sharding, strategy=strategy, shard_size=shard_size)))


def with_nodes(spec: RunSpec, nodes: int) -> RunSpec:
    """The spec on another number of nodes (same ranks per node)."""
    world = nodes * spec.nproc_per_node
    mesh = mesh_for(spec.strategy, spec.sharding.shard_size, world, spec.nproc_per_node)
    batch = spec.train.batch_size * spec.train.grad_accum * world
    return checked(dataclasses.replace(
        spec, cluster=dataclasses.replace(spec.cluster, nodes=nodes), nodes=nodes,
        world_size=world, mesh=mesh, global_batch=batch,
        tokens_per_step=batch * spec.train.seq_len))


def with_optim(spec: RunSpec, name: str) -> RunSpec:
    """The spec with another optimizer (its block size at the default)."""
    return checked(dataclasses.replace(
        spec, optim=dataclasses.replace(spec.optim, name=name, block_size=None)))


def with_method(spec: RunSpec, method: str) -> RunSpec:
    """The spec with another finetune.method (its adapter options as they are; the recipe's
    rank and alpha where a full fine-tuning spec has none)."""
    ft = dataclasses.replace(spec.finetune, method=method)
    if method != "full":
        table = recipes.recipe_values(
            recipes.size_of(spec.model, pretrained=bool(spec.model.path))[0], method,
            OBJECTIVES[spec.objective.name].pairs)
        ft = dataclasses.replace(ft, rank=ft.rank if ft.rank is not None else table["rank"],
                                 alpha=ft.alpha if ft.alpha is not None else table["alpha"])
    # (an adapter run exports its PEFT adapter: export_hf, on by default for small full
    # fine-tunes, does not apply)
    save = dataclasses.replace(spec.save, export_hf=spec.save.export_hf and method == "full")
    return checked(dataclasses.replace(spec, finetune=ft, save=save))


def with_train(spec: RunSpec, **changes) -> RunSpec:
    """The spec with train.<key>=<value> changes (the step's token counts follow)."""
    t = dataclasses.replace(spec.train, **changes)
    batch = t.batch_size * t.grad_accum * spec.world_size
    return checked(dataclasses.replace(spec, train=t, global_batch=batch,
                                       tokens_per_step=batch * t.seq_len))


def with_seq_len(spec: RunSpec, seq_len: int) -> RunSpec:
    """The spec at another train.seq_len."""
    return with_train(spec, seq_len=seq_len)


def with_checkpointing(spec: RunSpec, **changes) -> RunSpec:
    """The spec with checkpointing.<key>=<value> changes (mode, offload)."""
    return checked(dataclasses.replace(
        spec, checkpointing=dataclasses.replace(spec.checkpointing, **changes)))


def reference_spec(model: str, *, nodes: int = 1, gpus_per_node: int = 8, strategy: str = "full",
                   precision: str = "bf16", ac: str = "full", batch: int = 1, seq_len: int = 2048,
                   device_memory_gb: float = 80.0) -> RunSpec:
    """A RunSpec of GPU nodes that are not here, built without Hydra, for tables and what-ifs:
    ``nodes`` x ``gpus_per_node`` GPUs of ``device_memory_gb`` each (their RAM unknown)."""
    cfg = Config(model=model_preset(model), sharding=ShardingConfig(strategy=strategy),
                 precision=PrecisionConfig(name=precision),
                 checkpointing=CheckpointingConfig(mode=ac),
                 cluster=ClusterConfig(nodes=nodes, device="cuda", gpus_per_node=gpus_per_node,
                                       device_memory_gb=device_memory_gb),
                 data=DataConfig(),
                 train=TrainConfig(batch_size=batch, seq_len=seq_len),
                 output_dir="outputs/plan", resume="none")
    nodes_there = Placement(device="cuda", nodes=nodes, nproc_per_node=gpus_per_node,
                            on_this_host=False, gpus_per_node=gpus_per_node,
                            ram_source="not known: a plan for GPU nodes that are not here")
    return build_spec(cfg, placement=lambda _cfg, _out: nodes_there, output_dir="outputs/plan")
