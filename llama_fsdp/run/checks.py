"""Every check of a composed config before anything runs, each problem with its fix:
``spec.build_spec`` collects what they find and reports it all at once (ConfigError).
``unknown_keys`` and ``not_a_key`` also serve the command line's override check.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from omegaconf import DictConfig

from ..config import devices, strategies
from ..config.kernels import KERNELS
from ..config.schema import (
    AC_MODES,
    CLUSTERS,
    DEVICES,
    PRECISIONS,
    Config,
    FinetuneConfig,
    ModelConfig,
    TrainConfig,
)
from ..model.nf4 import target_problems
from ..config.optimizers import OPTIMIZERS
from ..config.precision import resolve_precision
from ..config.strategies import AUTO, MeshSpec


def check_choices(cfg: Config, problems: list[str]) -> None:
    for key, value, choices in (
        ("sharding.strategy", cfg.sharding.strategy, strategies.CHOICES),
        ("precision.name", cfg.precision.name, PRECISIONS),
        ("checkpointing.mode", cfg.checkpointing.mode, AC_MODES),
        ("cluster.kind", cfg.cluster.kind, CLUSTERS),
        ("cluster.device", cfg.cluster.device, DEVICES),
        ("finetune.method", cfg.finetune.method, FinetuneConfig.METHODS),
        ("optim.name", cfg.optim.name, tuple(OPTIMIZERS)),
        ("train.loss", cfg.train.loss, TrainConfig.LOSSES),
    ):
        if value not in choices:
            problems.append(f"{key}={value!r} is not one of {', '.join(choices)}")


def check_positive(cfg: Config, problems: list[str]) -> None:
    t = cfg.train
    for key, value, low in (
        ("train.batch_size", t.batch_size, 1),
        ("train.grad_accum", t.grad_accum, 1),
        ("train.seq_len", t.seq_len, 2),
        ("train.max_steps", t.max_steps, 1),
        ("train.log_every", t.log_every, 1),
        ("train.loss_chunk", t.loss_chunk, 1),
        ("cluster.nodes", 1 if cfg.cluster.nodes is None else cfg.cluster.nodes, 1),
        ("checkpointing.every_k", cfg.checkpointing.every_k, 1),
        ("save.keep_last", cfg.save.keep_last, 1),
    ):
        if value < low:
            problems.append(f"{key}={value} must be >= {low}")
    # (train.lr, min_lr_ratio, max_grad_norm: TrainConfig.problems, NaN and infinity too;
    # the warmup is judged against a max_steps that is valid, reported above otherwise)
    if t.warmup_steps < 0 or (t.max_steps >= 1 and t.warmup_steps >= t.max_steps):
        problems.append(
            f"train.warmup_steps={t.warmup_steps} must be in [0, train.max_steps={t.max_steps}): "
            f"set it below {max(t.max_steps, 1)} for a run this short, e.g. "
            f"train.warmup_steps={max(t.max_steps // 10, 0)}"
        )
    if cfg.save.every_steps < 0 or cfg.eval.every_steps < 0:
        problems.append("save.every_steps and eval.every_steps must be >= 0 (0 disables)")


def check_model(m: ModelConfig, t: TrainConfig, problems: list[str]) -> None:
    for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                "vocab_size"):
        if getattr(m, key) < 1:
            problems.append(f"model.{key}={getattr(m, key)} must be >= 1")
    if m.num_heads >= 1 and m.hidden_size % m.num_heads:
        problems.append(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}"
        )
    if m.num_kv_heads >= 1 and m.num_heads % m.num_kv_heads:
        problems.append(
            f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads="
            f"{m.num_kv_heads} (grouped-query attention needs whole groups)"
        )
    if m.attn_implementation not in KERNELS and "/" not in m.attn_implementation:
        problems.append(
            f"model.attn_implementation={m.attn_implementation!r} is not one of "
            f"{', '.join(KERNELS)} (or a hub kernel such as "
            "kernels-community/flash-attn)")
    if t.seq_len > m.max_position_embeddings:
        problems.append(
            f"train.seq_len={t.seq_len} exceeds model.max_position_embeddings="
            f"{m.max_position_embeddings}: lower train.seq_len"
        )


def unknown_keys(cfg: DictConfig, schema: type = Config, prefix: str = "") -> list[str]:
    """Keys of a composed config that its schema does not have, each with the closest valid
    key: Hydra's ``+key=value`` adds keys past the schema, and they would be silently ignored."""
    fields = {f.name for f in dataclasses.fields(schema)}
    out = []
    for key in cfg.keys():
        name = f"{prefix}{key}"
        if key not in fields:
            out.append(not_a_key(name, prefix, fields))
            continue
        node, kind = cfg._get_node(key), field_type(schema, key)
        if dataclasses.is_dataclass(kind) and isinstance(node, DictConfig) and not node._is_none():
            out += unknown_keys(node, kind, f"{name}.")
    return out


def not_a_key(name: str, prefix: str, fields: set[str]) -> str:
    """``name`` (under ``prefix``, "train." or "") is no field of its schema: the valid ones, and
    the closest."""
    close = difflib.get_close_matches(name.rsplit(".", 1)[-1], sorted(fields), n=1)
    hint = f"; did you mean {prefix}{close[0]}?" if close else ""
    return (f"{name} is not a config key (valid under {prefix.rstrip('.') or 'the root'}: "
            f"{', '.join(sorted(fields))}){hint}")


def field_type(schema: type, name: str) -> Any:
    """A dataclass field's type, Optional[X] as X."""
    kind = typing.get_type_hints(schema)[name]
    return next((a for a in typing.get_args(kind) if a is not type(None)), kind)


def check_devices(cfg: Config, device: str, nproc: int, problems: list[str]) -> None:
    c = cfg.cluster
    if nproc < 1:
        problems.append(f"cluster.nproc_per_node={nproc} must be >= 1")
    if c.kind == "local" and c.nodes != 1:
        problems.append(
            f"cluster.nodes={c.nodes} with cluster=local: a local run uses this host only; "
            "use cluster=slurm for several nodes, or sharding.shard_size to emulate them"
        )
    if device == "cuda" and c.kind in ("local", "torchrun") and not cfg.dry_run:
        # (torchrun: this node's GPUs; a dry run plans for GPUs it need not have)
        have = devices.local_cuda_count()
        if have == 0:
            problems.append("cluster.device=cuda but no CUDA device is visible: use cluster.device=cpu")
        elif nproc > have:
            problems.append(
                f"cluster.nproc_per_node={nproc} but only {have} GPU(s) are visible: "
                f"use cluster.nproc_per_node<={have}"
            )
    if c.kind == "slurm" and device == "cuda" and c.gpus_per_node and nproc > c.gpus_per_node:
        problems.append(
            f"cluster.nproc_per_node={nproc} exceeds cluster.gpus_per_node={c.gpus_per_node}"
        )
    if c.kind == "slurm" and c.timeout_min is None:
        problems.append("cluster.timeout_min is required with cluster=slurm (the job's --time, in "
                        "minutes): set cluster.timeout_min=<minutes>")
    for key in ("signal_delay_s", "max_requeues", "max_restarts"):
        if getattr(c, key) < 0:
            problems.append(f"cluster.{key}={getattr(c, key)} must be >= 0")
    if min(c.init_timeout_s, c.train_timeout_s) < 1:
        problems.append("cluster.init_timeout_s and cluster.train_timeout_s must be >= 1 second")
    precision = resolve_precision(cfg.precision.name, device)
    # (a machine with no GPU at all is told so by the launcher's preflight, not this)
    if device == "cuda" and precision in ("bf16", "mixed") and c.kind in ("local", "torchrun") \
            and devices.local_cuda_count() > 0 and not devices.local_bf16():
        problems.append(f"precision={precision} computes in bf16, which this GPU does not "
                        "support: use precision=fp32")
    check_offload(cfg, device, problems)


def check_offload(cfg: Config, device: str, problems: list[str]) -> None:
    """What goes to host memory: sharding.cpu_offload's shards, checkpointing.offload's layer
    inputs. ``cfg``: a Config, or a RunSpec (spec.variant_problems; the same fields)."""
    if cfg.sharding.cpu_offload and device != "cuda":
        problems.append(
            "sharding.cpu_offload=true needs CUDA (on CPU the parameters already live in host "
            "memory): drop it or run on GPUs"
        )
    elif cfg.sharding.cpu_offload and getattr(
            strategies.STRATEGIES.get(cfg.sharding.strategy), "ddp", False):
        problems.append(
            "sharding.cpu_offload=true with sharding=no_shard: offload moves FSDP shards to host "
            "memory, and no_shard keeps a full replica on every GPU; use sharding=full (or "
            "hybrid) with cpu_offload, or drop it"
        )
    if cfg.checkpointing.offload and cfg.checkpointing.mode == "none":
        problems.append(
            "checkpointing.offload=true with checkpointing=none: offload moves what activation "
            "checkpointing keeps (each wrapped layer's input) to host memory, and nothing is "
            "checkpointed; use checkpointing=full (or selective) with it, or drop it")


def check_finetune(cfg: Config, mesh: MeshSpec, problems: list[str]) -> None:
    """finetune's options, and for qlora the NF4 shapes over this shard group (nf4.py).
    ``cfg``: a Config, or a RunSpec (spec.variant_problems; the same fields)."""
    ft = cfg.finetune
    own = ft.problems()
    problems.extend(own)
    if ft.adapters and cfg.optim.lowbit:
        problems.append(
            f"finetune={ft.method} with optim={cfg.optim.name}: the adapters' AdamW moments are "
            "a small fraction of the run's memory (the plan's table shows them), so low-bit "
            "moments save next to nothing there; use optim=adamw with adapters, or "
            "finetune=full with low-bit moments")
    if ft.adapters and cfg.save.export_hf:
        problems.append(
            f"save.export_hf=true with finetune={ft.method}: an adapter run exports its PEFT "
            "adapter (always); for the whole model with the adapters merged in, use "
            "finetune.export_merged=true instead")
    if not ft.nf4:
        return
    m = cfg.model
    shapes_known = min(m.hidden_size, m.num_heads, m.num_kv_heads, m.intermediate_size) >= 1
    # (auto picks among the strategies whose shard group the NF4 shapes fit: plan.resolve_auto)
    if not own and shapes_known and cfg.sharding.strategy != AUTO:
        problems.extend(target_problems(ft, m, mesh.shard))
    if cfg.sharding.cpu_offload:
        problems.append("finetune=qlora with sharding.cpu_offload=true: the NF4 base is a "
                        "quarter of a 16-bit one and is not offloaded (untested with FSDP2's "
                        "CPU offload); drop sharding.cpu_offload, or use finetune=lora with it")
