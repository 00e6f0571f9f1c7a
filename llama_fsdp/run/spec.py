"""RunSpec: the composed config turned into one validated run object.

Pure Python: no process group and no GPU work. Every derived value (world size, mesh shape,
dtypes, global batch, tokens per step, output dir, tracking URI) is resolved here, and every
error that can be caught before processes start is reported here, all of them at once (the
checks themselves: validate.py).
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

from ..config import devices, strategies
from . import checks as validate
from ..config.kernels import AUTO as AUTO_KERNEL
from ..config.kernels import SDPA, VARLEN
from .checkpoint_checks import checkpoint_problems
from ..config.schema import (
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
    has_line_break,
    line_break,
)
from ..config.optimizers import DEFAULT as DEFAULT_OPTIMIZER
from ..config.precision import PRECISION_POLICIES, PrecisionPolicy, resolve_precision
from ..config.rundir import CACHE
from ..config.strategies import MeshSpec

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config that cannot run; the message lists every problem and its fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid run configuration ({len(problems)} problem(s)):\n{lines}")


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
    gpu: Optional[str]  # accelerator table key (llama_fsdp/config/devices.py); None on CPU / unknown
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
    launcher_ships: bool = False  # set by a launcher that delivers rank 0's spool while it waits
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)  # sft | dpo
    # set once the data is prepared (prepare.replan_for_records): the records of the fullest
    # micro-batch, which CUDA's flash varlen backward allocates for (plan/activations.py)
    records_per_micro_batch: Optional[int] = None

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
    return "cuda" if devices.local_cuda_count() > 0 else "cpu"


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
        return (cluster.gpus_per_node if cluster.kind == "slurm"
                else max(devices.local_cuda_count(), 1))
    return 2


def resolve_attention(m: ModelConfig, *, device: str, compute_dtype: str, packing: bool,
                      problems: list[str]) -> ModelConfig:
    """model.attn_implementation=auto made concrete, and an explicit varlen checked
    (llama_fsdp/model/attention.py; torch is imported only for CUDA runs). auto is varlen for packed
    rows: flash varlen_attn on CUDA (in 16-bit, where torch has it), block-sparse SDPA on CPU;
    SDPA otherwise (unpacked rows take its causal path)."""
    name = m.attn_implementation
    if device == "cuda" and name in (AUTO_KERNEL, VARLEN):
        from ..model import attention

        problems.extend(attention.problems(name, compute_dtype=compute_dtype))
        impl = attention.resolve_cuda(name, compute_dtype=compute_dtype, packing=packing)
    elif name == AUTO_KERNEL:
        impl = VARLEN if packing and device == "cpu" else SDPA
    else:
        impl = name
    return dataclasses.replace(m, attn_implementation=impl)


def _gpu_type(cfg: Config, device: str, problems: list[str]) -> Optional[str]:
    """The accelerator table key of this run's GPUs (None on CPU or for an unknown GPU)."""
    c = cfg.cluster
    if device != "cuda":
        return None
    if c.gpu_type is not None:
        if c.gpu_type not in devices.BY_KEY:
            problems.append(f"cluster.gpu_type={c.gpu_type!r} is not one of "
                            f"{', '.join(devices.BY_KEY)}: pick one, or set cluster.peak_tflops "
                            "and cluster.device_memory_gb")
            return None
        return c.gpu_type
    if c.kind in ("local", "torchrun") and (gpu := devices.local_gpu()) is not None:
        acc = devices.by_device_name(gpu[0])
        return acc.key if acc else None
    return devices.DEFAULT_GPU


def variant_problems(spec: RunSpec) -> list[str]:
    """The rules between a run's choices, asked again of a RunSpec the planner changed (another
    strategy, node count, optimizer, method, offload or sequence length): what build_spec would
    say of the same choices (validate.py's checks)."""
    problems: list[str] = []
    validate.check_model(spec.model, spec.train, problems)
    validate.check_finetune(spec, spec.mesh, problems)
    validate.check_offload(spec, spec.device, problems)
    problems.extend(spec.optim.problems(param_dtype=spec.policy.param_dtype,
                                        cpu_offload=spec.sharding.cpu_offload,
                                        full_state_dict=spec.save.full_state_dict))
    return problems


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
    if cfg.optim.name != DEFAULT_OPTIMIZER:
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
    from ..config import credentials as secrets

    if isinstance(cfg, DictConfig):
        unknown = validate.unknown_keys(cfg)
        if unknown:
            raise ConfigError(unknown)
        obj: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    else:
        obj = cfg
    try:  # the credentials travel in the environment (cli.plan_run), never in the spec
        obj = dataclasses.replace(obj, tracking=dataclasses.replace(
            obj.tracking, uri=secrets.strip_credentials(obj.tracking.uri)))
    except secrets.SecretInURI as e:
        raise ConfigError([str(e)]) from None
    config_yaml = secrets.config_yaml(cfg)  # oc.env values as their interpolation
    problems: list[str] = []
    validate.check_choices(obj, problems)
    validate.check_positive(obj, problems)
    validate.check_model(obj.model, obj.train, problems)
    base = launch_dir or Path.cwd()
    out = Path(output_dir or obj.output_dir)
    out = out if out.is_absolute() else (base / out)
    # (resume=auto looks in the run directory this launch writes to: under torchrun the
    # caller's output_dir, not the config's)
    problems.extend(checkpoint_problems(dataclasses.replace(obj, output_dir=str(out))))
    for node in (obj.data, obj.model, obj.train, obj.eval, obj.cluster, obj.tracking,
                 obj.objective):
        problems.extend(node.problems())
    if obj.cluster.kind == "slurm" and has_line_break(str(out)):  # in the #SBATCH lines
        problems.append(line_break("output_dir", str(out)))

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
    validate.check_devices(obj, device, nproc, problems)
    gpu = _gpu_type(obj, device, problems)
    strategy = obj.sharding.strategy
    mesh = strategies.mesh_for(strategy, obj.sharding.shard_size, world, nproc, problems)
    validate.check_finetune(obj, mesh, problems)
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
        cache_dir=str((base / (obj.cache_dir or CACHE)).resolve()),
        tracking_uri=resolve_tracking_uri(obj.tracking.uri, base),
        run_name=obj.tracking.run_name or point_name(sweep_point or {}) or _run_name(
            obj, strategy, precision.name, world, nproc, device),
        git_commit=_git_commit(), config_yaml=config_yaml, sweep_id=sweep_id, sweep_dir=sweep_dir,
        sweep_point=dict(sweep_point or {}), objective=obj.objective,
    )
