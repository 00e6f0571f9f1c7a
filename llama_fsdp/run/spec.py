"""RunSpec: the composed config turned into one validated run object.

Pure Python: no process group and no GPU work. Every derived value (device, world size, mesh
shape, dtypes, global batch, tokens per step, output dir, tracking URI) is resolved here, from
the config and the launcher's answers (``placement``: where the ranks run and what a node has),
and every error that can be caught before processes start is reported here, all of them at once
(the checks themselves: checks.py).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from ..config import credentials, devices, kernels, metrics, recipes, strategies
from ..config.objectives import DEFAULT as DEFAULT_OBJECTIVE
from ..config.objectives import OBJECTIVES
from ..config.optimizers import DEFAULT as DEFAULT_OPTIMIZER
from ..config.placement import Placement
from ..config.model_folder import adopt_folder_shape
from ..config.recipes import Recipe
from ..config.search import SearchTrial
from ..config.precision import PRECISION_POLICIES, PrecisionPolicy, resolve_precision
from ..config.rundir import CACHE, CACHE_ENV
from ..config.schema import (
    CheckpointingConfig,
    ClusterConfig,
    Config,
    DataConfig,
    EvalConfig,
    FinetuneConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    PrecisionConfig,
    SaveConfig,
    ShardingConfig,
    TrackingConfig,
    TrainConfig,
)
from ..config.strategies import MeshSpec
from ..tracking.store import resolve_tracking_uri
from . import checks

log = logging.getLogger(__name__)

# What build_spec asks the launcher: the placement of a typed config's ranks, given the run
# directory (launchers' Launcher.placement).
Placer = Callable[[Config, str], Placement]


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
    # the launcher's answers: where the ranks run, what each node has (config/placement.py)
    placement: Optional[Placement] = None
    # the optimizer's values in use and where each came from (config/recipes.py)
    recipe: Optional[Recipe] = None
    # a trial of a search with a pruner: where it reports its eval metric (config/search.py)
    trial: Optional[SearchTrial] = None

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
                "preference": OBJECTIVES[self.objective.name].pairs}

    def overview(self) -> dict[str, Any]:
        """The values a user checks before launching (printed before the plan)."""
        return {
            "model": self.model.name + (
                f" ({recipes.approx_params(self.model) / 1e6:.3g}M parameters, "
                f"{self.model.path})" if self.model.path else ""),
            "strategy": self.strategy,
            "precision": self.precision.name,
            "attention": self.model.attn_implementation,
            "activation_checkpointing": self.checkpointing.mode,
            "finetune": self.finetune.method + (
                f" (rank {self.finetune.rank}, alpha {self.finetune.alpha:g}, "
                f"{', '.join(self.finetune.target_modules)})"
                if self.finetune.method != "full" else ""),
            "optimizer": self.optim.name,
            **({"learning rate": f"{recipes.show(self.train.lr)} "
                                 f"({self.recipe.sources[recipes.LR]})",
                "hyperparameters": self.recipe.grouped(
                    [k for k in self.recipe.values if k != recipes.LR])}
               if self.recipe else {}),
            **({"objective": f"{self.objective.name} (beta {self.objective.beta:g}, "
                             f"{self.objective.loss}, reference {self.objective.reference})"}
               if OBJECTIVES[self.objective.name].pairs else {}),
            "device": f"{self.device} ({self.backend})",
            "world_size": f"{self.world_size} = {self.nodes} node(s) x {self.nproc_per_node}",
            "mesh": " x ".join(f"{n}={s}" for n, s in zip(self.mesh.dim_names, self.mesh.shape)),
            "micro_batch x grad_accum x dp": (
                f"{self.train.batch_size} x {self.train.grad_accum} x {self.dp_size}"
                f" = {self.global_batch}"
            ),
            metrics.TOKENS_PER_STEP: self.tokens_per_step,
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


def _renamed_keys(c: ClusterConfig) -> ClusterConfig:
    """Config keys read under their earlier names: cluster.time_min is cluster.timeout_min."""
    if c.time_min is None:
        return c
    log.warning("cluster.time_min is the earlier name of cluster.timeout_min: read as "
                "cluster.timeout_min=%d", c.time_min)
    return dataclasses.replace(c, timeout_min=c.time_min, time_min=None)


# the short names of keys often swept, so that a point's values show in the width MLflow's
# Run Name column gives them ("b=2 shard=full", not "batch_size=2 shardi...")
SHORT_KEYS = {"batch_size": "b", "sharding": "shard", "strategy": "shard", "finetune": "ft",
              "checkpointing": "ac", "precision": "prec", "seq_len": "seq"}


def point_name(values: dict[str, str]) -> str:
    """A sweep point's run name: its values of the swept keys, with short keys
    ("b=2 shard=full")."""
    return " ".join(f"{SHORT_KEYS.get(key.split('.')[-1], key.split('.')[-1])}="
                    f"{_one_line(value)}" for key, value in values.items())


def _one_line(value: str) -> str:
    """A swept value as one line of a run name: control characters (a line break, a tab)
    written as their escapes (MLflow's table and a sweep's summary show names in one line)."""
    import unicodedata

    return "".join(repr(c)[1:-1] if unicodedata.category(c).startswith("C") else c
                   for c in str(value))


def _run_name(cfg: Config, strategy: str, precision: str, world: int, nproc: int,
              device: str) -> str:
    """What a single run is, short enough for the MLflow table: "tiny shard=full fp32 2xcpu b8",
    with the method and the optimizer where they are not the defaults ("70b qlora shard=full
    bf16 ..."); the sharding is named as such, so that "lora full" never reads as both."""
    nodes = f"{cfg.cluster.nodes}x" if cfg.cluster.nodes > 1 else ""
    parts = [cfg.model.name, f"shard={strategy}", precision, f"{nodes}{nproc}x{device}",
             f"b{cfg.train.batch_size}"]
    if cfg.checkpointing.mode != "none":
        parts.insert(3, f"ac={cfg.checkpointing.mode}")
    if cfg.optim.name != DEFAULT_OPTIMIZER:
        parts.insert(3, cfg.optim.name)
    if cfg.finetune.method != "full":
        parts.insert(1, cfg.finetune.method)
    if cfg.objective.name != DEFAULT_OBJECTIVE:
        parts.insert(1, cfg.objective.name)
    return " ".join(parts)


def _home(path: Optional[str]) -> Optional[str]:
    """``~`` at the start of a path as the user's home (``~/x`` is never a folder named ~)."""
    return str(Path(path).expanduser()) if path and path.startswith("~") else path


def expand_paths(cfg: Config) -> Config:
    """The config's paths with ``~`` expanded (output_dir and cache_dir: build_spec)."""
    d = cfg.data
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, path=_home(cfg.model.path)),
        data=dataclasses.replace(d, path=_home(d.path), eval_path=_home(d.eval_path),
                                 tokenizer=_home(d.tokenizer),
                                 chat_template=_home(d.chat_template)),
        resume=_home(cfg.resume) or cfg.resume)


def typed_config(cfg: DictConfig | Config) -> Config:
    """The composed config as its dataclasses, with no key the schema lacks (ConfigError)."""
    if not isinstance(cfg, DictConfig):
        return cfg
    unknown = checks.unknown_keys(cfg)
    if unknown:
        raise ConfigError(unknown)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


SMALL_EXPORT_PARAMS = 100_000_000  # save.export_hf=null exports full fine-tunes below this


def resolve_exports(obj: Config) -> Config:
    """save.export_hf=null: true for a full fine-tune of a small model (the tiny default leaves
    a model behind) or when eval.harness.tasks are set (the harness scores the export); under
    LoRA / QLoRA the harness turns on finetune.export_merged (it scores the merged model)."""
    save, ft, harness = obj.save, obj.finetune, obj.eval.harness
    if ft.method in FinetuneConfig.METHODS and ft.adapters:
        if harness.tasks and not ft.export_merged:
            obj = dataclasses.replace(obj, finetune=dataclasses.replace(ft, export_merged=True))
        return dataclasses.replace(obj, save=dataclasses.replace(
            save, export_hf=bool(save.export_hf)))
    export = save.export_hf
    if export is None:
        export = recipes.approx_params(obj.model) < SMALL_EXPORT_PARAMS
    return dataclasses.replace(obj, save=dataclasses.replace(
        save, export_hf=bool(export or harness.tasks)))


def build_spec(cfg: DictConfig | Config, *, placement: Placer,
               output_dir: Optional[str] = None, launch_dir: Optional[Path] = None,
               sweep_id: Optional[str] = None, sweep_dir: Optional[str] = None,
               sweep_point: Optional[dict[str, str]] = None,
               trial: Optional[SearchTrial] = None) -> RunSpec:
    """Validate a composed config and resolve every derived value; raise ConfigError.
    ``placement``: the launcher's answers for the config (``Launcher.placement``)."""
    cfg = adopt_folder_shape(cfg)  # model.path alone: the folder's shape, name and size
    obj = typed_config(cfg)
    try:  # the credentials travel in the environment (cli.plan_run), never in the spec
        obj = dataclasses.replace(obj, tracking=dataclasses.replace(
            obj.tracking, uri=credentials.strip_credentials(obj.tracking.uri)))
    except credentials.SecretInURI as e:
        raise ConfigError([str(e)]) from None
    config_yaml = credentials.config_yaml(cfg)  # oc.env values as their interpolation
    base = launch_dir or Path.cwd()
    obj = expand_paths(obj)
    # (an unknown objective is refused by config_problems; its recipe is SFT's meanwhile)
    known = OBJECTIVES.get(obj.objective.name)
    obj, recipe = recipes.resolve(obj, pairs=bool(known and known.pairs))
    obj = resolve_exports(obj)
    obj = dataclasses.replace(obj, eval=obj.eval.resolved(obj.data.name))
    out = Path(output_dir or obj.output_dir).expanduser()
    out = out if out.is_absolute() else (base / out)
    # (resume=auto looks in the run directory this launch writes to: under torchrun the
    # caller's output_dir, not the config's)
    problems = checks.config_problems(dataclasses.replace(obj, output_dir=str(out)))
    tracking_uri = resolve_tracking_uri(obj.tracking.uri, base)
    problems += checks.tracking_store_problems(tracking_uri, obj.tracking.enabled)

    obj = dataclasses.replace(obj, cluster=_renamed_keys(obj.cluster))
    place = placement(obj, str(out))
    device, nproc = place.device, place.nproc_per_node
    obj = dataclasses.replace(obj, cluster=dataclasses.replace(
        obj.cluster, nodes=place.nodes, nproc_per_node=nproc))
    world = place.nodes * max(nproc, 1)
    strategy = obj.sharding.strategy
    mesh = strategies.mesh_for(strategy, obj.sharding.shard_size, world, nproc)
    precision = dataclasses.replace(obj.precision,
                                    name=resolve_precision(obj.precision.name, device))
    policy = PRECISION_POLICIES.get(precision.name)
    problems += checks.derived_problems(
        obj, place=place, mesh=mesh, world=world,
        param_dtype=policy.param_dtype if policy else None,
        compute_dtype=policy.compute_dtype if policy else None)
    if problems:
        raise ConfigError(problems)

    model = dataclasses.replace(obj.model, attn_implementation=kernels.resolve(
        obj.model.attn_implementation, device=device, compute_dtype=policy.compute_dtype,
        # a row of an objective with pairs holds two records at least: the pair
        packing=obj.data.packing or OBJECTIVES[obj.objective.name].pairs))
    global_batch = obj.train.batch_size * obj.train.grad_accum * world
    return RunSpec(
        model=model, sharding=obj.sharding, precision=precision,
        checkpointing=obj.checkpointing, cluster=obj.cluster, data=obj.data,
        finetune=obj.finetune, optim=obj.optim, train=obj.train,
        eval=obj.eval, save=obj.save, tracking=obj.tracking, resume=obj.resume,
        dry_run=obj.dry_run, force=obj.force,
        strategy=strategy, device=device, backend="nccl" if device == "cuda" else "gloo",
        gpu=gpu_key(obj.cluster, place), nodes=place.nodes, nproc_per_node=nproc,
        world_size=world, mesh=mesh, policy=policy, global_batch=global_batch,
        tokens_per_step=global_batch * obj.train.seq_len, output_dir=str(out.resolve()),
        cache_dir=str((base / Path(obj.cache_dir or os.environ.get(CACHE_ENV) or CACHE)
                       .expanduser()).resolve()),
        tracking_uri=tracking_uri,
        run_name=obj.tracking.run_name or (point_name(sweep_point or {}) or _run_name(
            obj, strategy, precision.name, world, nproc, device))[:checks.MAX_RUN_NAME],
        git_commit=_git_commit(), config_yaml=config_yaml, sweep_id=sweep_id, sweep_dir=sweep_dir,
        sweep_point=dict(sweep_point or {}), objective=obj.objective, placement=place,
        recipe=recipe, trial=trial,
    )


def gpu_key(c: ClusterConfig, place: Placement) -> Optional[str]:
    """The accelerator table key of the run's GPUs: cluster.gpu_type, else the GPU the ranks
    see here, else the default a cluster's GPU job is planned for (None on CPU, or for a GPU
    the table lacks)."""
    if place.device != "cuda":
        return None
    if c.gpu_type is not None:
        return c.gpu_type
    if place.gpu_name is not None:
        acc = devices.by_device_name(place.gpu_name)
        return acc.key if acc else None
    return devices.DEFAULT_GPU
