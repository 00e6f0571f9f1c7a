"""RunSpec: the composed config turned into one validated run object.

Pure Python: no process group and no GPU work. Every derived value (world size, mesh shape,
dtypes, global batch, tokens per step, output dir, tracking URI) is resolved here, and every
error that can be caught before processes start is caught here, all of them at once.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from . import strategies
from .config import (
    AC_MODES,
    CLUSTERS,
    DEVICES,
    PRECISIONS,
    CheckpointingConfig,
    ClusterConfig,
    Config,
    DataConfig,
    FinetuneConfig,
    EvalConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    PrecisionConfig,
    SaveConfig,
    ShardingConfig,
    TrackingConfig,
    TrainConfig,
)
from .strategies import AUTO, MeshSpec

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config that cannot run; the message lists every problem and its fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid run configuration ({len(problems)} problem(s)):\n{lines}")


@dataclass(frozen=True)
class PrecisionPolicy:
    """Dtype names (strings keep this module free of torch)."""

    param_dtype: str  # dtype of the sharded parameters (and so the optimizer state)
    compute_dtype: str  # dtype of the unsharded parameters used in forward/backward
    reduce_dtype: str  # dtype of gradient reduce-scatter / all-reduce

    @property
    def frozen_dtype(self) -> str:
        """dtype of weights that never train (a LoRA base): the compute dtype, since no
        optimizer reads them and a master copy would be memory for nothing."""
        return self.compute_dtype


# Bytes per element of the dtypes a policy names (torch dtypes of the same names: getattr(torch, n)).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

PRECISION_POLICIES = {
    "fp32": PrecisionPolicy("float32", "float32", "float32"),
    "mixed": PrecisionPolicy("float32", "bfloat16", "float32"),
    "bf16": PrecisionPolicy("bfloat16", "bfloat16", "bfloat16"),
}


@dataclass(frozen=True)
class RunSpec:
    model: ModelConfig
    sharding: ShardingConfig
    precision: PrecisionConfig
    checkpointing: CheckpointingConfig
    cluster: ClusterConfig
    data: DataConfig
    finetune: FinetuneConfig
    optim: OptimConfig
    train: TrainConfig
    eval: EvalConfig
    save: SaveConfig
    tracking: TrackingConfig
    resume: str
    dry_run: bool
    force: bool
    # Derived
    strategy: str
    device: str
    backend: str
    gpu: Optional[str]  # accelerator table key (llama_fsdp/devices.py); None on CPU / unknown
    nodes: int
    nproc_per_node: int
    world_size: int
    mesh: MeshSpec
    policy: PrecisionPolicy
    global_batch: int
    tokens_per_step: int
    output_dir: str
    cache_dir: str
    tracking_uri: str
    run_name: str
    git_commit: str
    config_yaml: str = field(repr=False)
    sweep_id: Optional[str] = None
    sweep_dir: Optional[str] = None  # a sweep point: its sweep's directory (the parent run)
    sweep_point: dict[str, str] = field(default_factory=dict)  # its values of the swept keys
    restart: int = 0  # set by the launcher: how many times this run was restarted or requeued
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)  # sft | dpo

    @property
    def dp_size(self) -> int:
        return self.world_size

    def data_kwargs(self, *, dp_rank: int, announce: bool) -> dict[str, Any]:
        """``data.build_data``'s arguments besides the data node, for one data-parallel rank:
        the driver (rank 0's view, announcing) and every rank build the same rows from them."""
        return {"seq_len": self.train.seq_len, "micro_batch": self.train.batch_size,
                "dp_rank": dp_rank, "dp_world": self.dp_size, "seed": self.train.seed,
                "cache_dir": Path(self.cache_dir), "vocab_size": self.model.vocab_size,
                "model_path": self.model.path, "announce": announce,
                "preference": self.objective.name == "dpo"}

    def summary(self) -> dict[str, Any]:
        """The values a user checks before launching."""
        return {
            "model": self.model.name,
            "strategy": self.strategy,
            "precision": self.precision.name,
            "attention": self.model.attn_implementation,
            "activation_checkpointing": self.checkpointing.mode,
            "finetune": self.finetune.method + (
                f" (rank {self.finetune.rank}, alpha {self.finetune.alpha:g}, "
                f"{', '.join(self.finetune.target_modules)})"
                if self.finetune.method != "full" else ""),
            "optimizer": self.optim.name,
            **({"objective": f"dpo (beta {self.objective.beta:g}, {self.objective.loss}, "
                             f"reference {self.objective.reference})"}
               if self.objective.name == "dpo" else {}),
            "device": f"{self.device} ({self.backend})",
            "world_size": f"{self.world_size} = {self.nodes} node(s) x {self.nproc_per_node}",
            "mesh": " x ".join(f"{n}={s}" for n, s in zip(self.mesh.dim_names, self.mesh.shape)),
            "micro_batch x grad_accum x dp": (
                f"{self.train.batch_size} x {self.train.grad_accum} x {self.dp_size}"
                f" = {self.global_batch}"
            ),
            "tokens_per_step": self.tokens_per_step,
            "output_dir": self.output_dir,
            "tracking": self.tracking_uri if self.tracking.enabled else "disabled",
        }


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def resolve_tracking_uri(uri: str, base: Path) -> str:
    """Make relative sqlite/file stores absolute so every rank and node writes the same one."""
    for scheme in ("sqlite:///", "file://"):
        if uri.startswith(scheme):
            path = uri[len(scheme):]
            if not os.path.isabs(path):
                return scheme + str((base / path).resolve())
    if "://" not in uri:  # a plain directory
        return str((base / uri).resolve())
    return uri


def _local_bf16() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_bf16_supported())
    except (ImportError, RuntimeError):
        return False


def _local_cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _renamed_keys(c: ClusterConfig) -> ClusterConfig:
    """Config keys read under their earlier names: cluster.time_min is cluster.timeout_min."""
    if c.time_min is None:
        return c
    log.warning("cluster.time_min is the earlier name of cluster.timeout_min: read as "
                "cluster.timeout_min=%d", c.time_min)
    return dataclasses.replace(c, timeout_min=c.time_min, time_min=None)


def _resolve_device(cluster: ClusterConfig) -> str:
    if cluster.device != "auto":
        return cluster.device
    if cluster.kind == "slurm":
        return "cuda" if cluster.gpus_per_node > 0 else "cpu"
    return "cuda" if _local_cuda_count() > 0 else "cpu"


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_layout(cluster: ClusterConfig, problems: list[str],
                    environ: Optional[dict] = None) -> tuple[int, int]:
    """cluster=torchrun: (nodes, ranks per node) from the environment torchrun or a Kubernetes
    operator gives each process (WORLD_SIZE, LOCAL_WORLD_SIZE: 1 when unset, as a bare
    RANK/WORLD_SIZE launch has one process per node; GROUP_WORLD_SIZE), checked against the
    config's values where it sets them."""
    e = os.environ if environ is None else environ
    missing = [v for v in TORCHRUN_VARS if not e.get(v)]
    if missing:
        problems.append(
            f"cluster=torchrun runs in a process started by torchrun or a Kubernetes operator, "
            f"but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set here: start "
            "it with `torchrun --nnodes=N --nproc_per_node=G --rdzv-backend=c10d "
            "--rdzv-endpoint=HOST:PORT -m llama_fsdp cluster=torchrun ...`, or use "
            "cluster=local on one host")
        return cluster.nodes or 1, cluster.nproc_per_node or 1
    world, nproc = int(e["WORLD_SIZE"]), int(e.get("LOCAL_WORLD_SIZE") or 1)
    nodes = int(e.get("GROUP_WORLD_SIZE") or max(world // max(nproc, 1), 1))
    if nodes * nproc != world:
        problems.append(f"the environment has WORLD_SIZE={world} processes, not a whole number "
                        f"of nodes of LOCAL_WORLD_SIZE={nproc}: give every node the same "
                        "--nproc_per_node")
    for key, ours, theirs in (("nodes", cluster.nodes, nodes),
                              ("nproc_per_node", cluster.nproc_per_node, nproc)):
        if ours is not None and ours != theirs:
            problems.append(f"cluster.{key}={ours} but the launcher started {theirs} (from "
                            f"WORLD_SIZE={world}, LOCAL_WORLD_SIZE={nproc}): drop cluster.{key} "
                            "(cluster=torchrun reads it from the environment) or launch "
                            f"{ours}")
    return nodes, nproc


def _resolve_nproc(cluster: ClusterConfig, device: str) -> int:
    if cluster.nproc_per_node is not None:
        return cluster.nproc_per_node
    if device == "cuda":
        return cluster.gpus_per_node if cluster.kind == "slurm" else max(_local_cuda_count(), 1)
    return 2


def _check_choices(cfg: Config, problems: list[str]) -> None:
    for key, value, choices in (
        ("sharding.strategy", cfg.sharding.strategy, strategies.CHOICES),
        ("precision.name", cfg.precision.name, PRECISIONS),
        ("checkpointing.mode", cfg.checkpointing.mode, AC_MODES),
        ("cluster.kind", cfg.cluster.kind, CLUSTERS),
        ("cluster.device", cfg.cluster.device, DEVICES),
        ("finetune.method", cfg.finetune.method, FinetuneConfig.METHODS),
        ("optim.name", cfg.optim.name, OptimConfig.NAMES),
    ):
        if value not in choices:
            problems.append(f"{key}={value!r} is not one of {', '.join(choices)}")


def _check_positive(cfg: Config, problems: list[str]) -> None:
    t = cfg.train
    for key, value, low in (
        ("train.batch_size", t.batch_size, 1),
        ("train.grad_accum", t.grad_accum, 1),
        ("train.seq_len", t.seq_len, 2),
        ("train.max_steps", t.max_steps, 1),
        ("train.log_every", t.log_every, 1),
        ("cluster.nodes", 1 if cfg.cluster.nodes is None else cfg.cluster.nodes, 1),
        ("checkpointing.every_k", cfg.checkpointing.every_k, 1),
        ("save.keep_last", cfg.save.keep_last, 1),
    ):
        if value < low:
            problems.append(f"{key}={value} must be >= {low}")
    if t.lr <= 0:
        problems.append(f"train.lr={t.lr} must be > 0")
    if not 0 <= t.min_lr_ratio <= 1:
        problems.append(f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    if t.warmup_steps < 0 or t.warmup_steps >= max(t.max_steps, 1):
        problems.append(
            f"train.warmup_steps={t.warmup_steps} must be in [0, train.max_steps={t.max_steps}): "
            f"set it below {max(t.max_steps, 1)} for a run this short, e.g. "
            f"train.warmup_steps={t.max_steps // 10}"
        )
    if t.max_grad_norm < 0:
        problems.append(f"train.max_grad_norm={t.max_grad_norm} must be >= 0 (0 disables clipping)")
    if cfg.save.every_steps < 0 or cfg.eval.every_steps < 0:
        problems.append("save.every_steps and eval.every_steps must be >= 0 (0 disables)")


# model.attn_implementation: ours (auto, varlen: llama_fsdp/attention.py), then transformers'
ATTENTION_KERNELS = ("auto", "varlen", "sdpa", "eager", "flex_attention", "flash_attention_2",
                     "flash_attention_3", "flash_attention_4")


def _check_model(m: ModelConfig, t: TrainConfig, problems: list[str]) -> None:
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
    if m.attn_implementation not in ATTENTION_KERNELS and "/" not in m.attn_implementation:
        problems.append(
            f"model.attn_implementation={m.attn_implementation!r} is not one of "
            f"{', '.join(ATTENTION_KERNELS)} (or a hub kernel such as "
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
    import difflib

    close = difflib.get_close_matches(name.rsplit(".", 1)[-1], sorted(fields), n=1)
    hint = f"; did you mean {prefix}{close[0]}?" if close else ""
    return (f"{name} is not a config key (valid under {prefix.rstrip('.') or 'the root'}: "
            f"{', '.join(sorted(fields))}){hint}")


def field_type(schema: type, name: str) -> Any:
    """A dataclass field's type, Optional[X] as X."""
    import typing

    kind = typing.get_type_hints(schema)[name]
    return next((a for a in typing.get_args(kind) if a is not type(None)), kind)


def resolve_precision(name: str, device: str) -> str:
    """precision=auto: mixed on CUDA (bf16 compute, fp32 master weights), fp32 on CPU."""
    if name != "auto":
        return name
    return "mixed" if device == "cuda" else "fp32"


def resolve_attention(m: ModelConfig, *, device: str, compute_dtype: str, packing: bool,
                      problems: list[str]) -> ModelConfig:
    """model.attn_implementation=auto made concrete, and an explicit varlen checked
    (llama_fsdp/attention.py; torch is imported only for CUDA runs). auto is varlen for packed
    rows: flash varlen_attn on CUDA (in 16-bit, where torch has it), block-sparse SDPA on CPU;
    SDPA otherwise (unpacked rows take its causal path)."""
    name = m.attn_implementation
    if device == "cuda" and name in ("auto", "varlen"):
        from . import attention

        problems.extend(attention.problems(name, compute_dtype=compute_dtype))
        impl = attention.resolve_cuda(name, compute_dtype=compute_dtype, packing=packing)
    elif name == "auto":
        impl = "varlen" if packing and device == "cpu" else "sdpa"
    else:
        impl = name
    return dataclasses.replace(m, attn_implementation=impl)


def _gpu_type(cfg: Config, device: str, problems: list[str]) -> Optional[str]:
    """The accelerator table key of this run's GPUs (None on CPU or for an unknown GPU)."""
    from .devices import BY_KEY, DEFAULT_GPU, by_device_name, local_gpu

    c = cfg.cluster
    if device != "cuda":
        return None
    if c.gpu_type is not None:
        if c.gpu_type not in BY_KEY:
            problems.append(f"cluster.gpu_type={c.gpu_type!r} is not one of {', '.join(BY_KEY)}: "
                            "pick one, or set cluster.peak_tflops and cluster.device_memory_gb")
            return None
        return c.gpu_type
    if c.kind in ("local", "torchrun") and (gpu := local_gpu()) is not None:
        acc = by_device_name(gpu[0])
        return acc.key if acc else None
    return DEFAULT_GPU


def _check_devices(cfg: Config, device: str, nproc: int, problems: list[str]) -> None:
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
        have = _local_cuda_count()
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
    if cfg.tracking.final_delivery_s < 0:
        problems.append(f"tracking.final_delivery_s={cfg.tracking.final_delivery_s} must be >= 0 "
                        "(seconds; 0 leaves undelivered events on disk at once)")
    precision = resolve_precision(cfg.precision.name, device)
    # (a machine with no GPU at all is told so by the launcher's preflight, not this)
    if device == "cuda" and precision in ("bf16", "mixed") and c.kind in ("local", "torchrun") \
            and _local_cuda_count() > 0 and not _local_bf16():
        problems.append(f"precision={precision} computes in bf16, which this GPU does not "
                        "support: use precision=fp32")
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


def _check_finetune(cfg: Config, mesh: MeshSpec, problems: list[str]) -> None:
    """finetune's options, and for qlora the NF4 shapes over this shard group (nf4.py)."""
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
    from .nf4 import target_problems

    m = cfg.model
    shapes_known = min(m.hidden_size, m.num_heads, m.num_kv_heads, m.intermediate_size) >= 1
    # (auto picks among the strategies whose shard group the NF4 shapes fit: plan.resolve_auto)
    if not own and shapes_known and cfg.sharding.strategy != AUTO:
        problems.extend(target_problems(ft, m, mesh.shard))
    if cfg.sharding.cpu_offload:
        problems.append("finetune=qlora with sharding.cpu_offload=true: the NF4 base is a "
                        "quarter of a 16-bit one and is not offloaded (untested with FSDP2's "
                        "CPU offload); drop sharding.cpu_offload, or use finetune=lora with it")


def point_name(values: dict[str, str]) -> str:
    """A sweep point's run name: its values of the swept keys, with short keys
    ("batch_size=2 sharding=full")."""
    return " ".join(f"{key.split('.')[-1]}={value}" for key, value in values.items())


def _run_name(cfg: Config, strategy: str, precision: str, world: int, nproc: int,
              device: str) -> str:
    """What a single run is, short enough for the MLflow table: "tiny full fp32 2xcpu b8", with
    the method and the optimizer where they are not the defaults ("70b qlora full bf16 ...")."""
    nodes = f"{cfg.cluster.nodes}x" if cfg.cluster.nodes > 1 else ""
    parts = [cfg.model.name, strategy, precision, f"{nodes}{nproc}x{device}",
             f"b{cfg.train.batch_size}"]
    if cfg.checkpointing.mode != "none":
        parts.insert(3, f"ac={cfg.checkpointing.mode}")
    if cfg.optim.name != "adamw":
        parts.insert(3, cfg.optim.name)
    if cfg.finetune.method != "full":
        parts.insert(1, cfg.finetune.method)
    if cfg.objective.name != "sft":
        parts.insert(1, cfg.objective.name)
    return " ".join(parts)


def build_spec(cfg: DictConfig | Config, *, output_dir: Optional[str] = None,
               launch_dir: Optional[Path] = None, sweep_id: Optional[str] = None,
               sweep_dir: Optional[str] = None,
               sweep_point: Optional[dict[str, str]] = None) -> RunSpec:
    """Validate a composed config and resolve every derived value; raise ConfigError."""
    if isinstance(cfg, DictConfig):
        unknown = unknown_keys(cfg)
        if unknown:
            raise ConfigError(unknown)
        config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
        obj: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    else:
        obj = cfg
        config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True)
    problems: list[str] = []
    _check_choices(obj, problems)
    _check_positive(obj, problems)
    _check_model(obj.model, obj.train, problems)
    from .checkpoint.checks import checkpoint_problems  # model.path vs config.json, resume, saves

    base = launch_dir or Path.cwd()
    out = Path(output_dir or obj.output_dir)
    out = out if out.is_absolute() else (base / out)
    # (resume=auto looks in the run directory this launch writes to: under torchrun the
    # caller's output_dir, not the config's)
    problems.extend(checkpoint_problems(dataclasses.replace(obj, output_dir=str(out))))
    problems.extend(obj.data.problems())
    problems.extend(obj.objective.problems())

    obj = dataclasses.replace(obj, cluster=_renamed_keys(obj.cluster))
    device = _resolve_device(obj.cluster)
    if obj.cluster.kind == "torchrun":
        nodes, nproc = torchrun_layout(obj.cluster, problems)
        obj = dataclasses.replace(obj, cluster=dataclasses.replace(
            obj.cluster, nodes=nodes, nproc_per_node=nproc))
    else:
        nproc = _resolve_nproc(obj.cluster, device)
        if obj.cluster.nodes is None:
            problems.append(f"cluster.nodes=null with cluster={obj.cluster.kind}: set a number "
                            "of nodes")
            obj = dataclasses.replace(obj, cluster=dataclasses.replace(obj.cluster, nodes=1))
    world = obj.cluster.nodes * max(nproc, 1)
    _check_devices(obj, device, nproc, problems)
    gpu = _gpu_type(obj, device, problems)
    strategy = obj.sharding.strategy
    mesh = strategies.mesh_for(strategy, obj.sharding.shard_size, world, nproc, problems)
    _check_finetune(obj, mesh, problems)
    if obj.checkpointing.mode == "selective" and obj.checkpointing.every_k > obj.model.num_layers:
        problems.append(
            f"checkpointing.every_k={obj.checkpointing.every_k} exceeds model.num_layers="
            f"{obj.model.num_layers}: nothing would be checkpointed"
        )
    precision = dataclasses.replace(obj.precision,
                                    name=resolve_precision(obj.precision.name, device))
    policy = PRECISION_POLICIES.get(precision.name)
    model = obj.model
    if policy is not None:
        problems.extend(obj.optim.problems(param_dtype=policy.param_dtype,
                                           cpu_offload=obj.sharding.cpu_offload,
                                           full_state_dict=obj.save.full_state_dict))
        model = resolve_attention(obj.model, device=device, compute_dtype=policy.compute_dtype,
                                  # a DPO row holds two records at least: the pair
                                  packing=obj.data.packing or obj.objective.name == "dpo",
                                  problems=problems)
    if problems:
        raise ConfigError(problems)

    global_batch = obj.train.batch_size * obj.train.grad_accum * world
    return RunSpec(
        model=model, sharding=obj.sharding, precision=precision,
        checkpointing=obj.checkpointing, cluster=obj.cluster, data=obj.data,
        finetune=obj.finetune, optim=obj.optim, train=obj.train,
        eval=obj.eval, save=obj.save, tracking=obj.tracking, resume=obj.resume,
        dry_run=obj.dry_run, force=obj.force,
        strategy=strategy, device=device, backend="nccl" if device == "cuda" else "gloo", gpu=gpu,
        nodes=obj.cluster.nodes, nproc_per_node=nproc, world_size=world, mesh=mesh,
        policy=policy, global_batch=global_batch,
        tokens_per_step=global_batch * obj.train.seq_len, output_dir=str(out.resolve()),
        cache_dir=str((base / (obj.cache_dir or "outputs/cache")).resolve()),
        tracking_uri=resolve_tracking_uri(obj.tracking.uri, base),
        run_name=obj.tracking.run_name or point_name(sweep_point or {}) or _run_name(
            obj, strategy, precision.name, world, nproc, device),
        git_commit=_git_commit(), config_yaml=config_yaml, sweep_id=sweep_id, sweep_dir=sweep_dir,
        sweep_point=dict(sweep_point or {}), objective=obj.objective,
    )
