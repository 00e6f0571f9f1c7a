"""The plan of a run (``make_plan`` -> ``Plan``: parameters, FLOPs per token, memory per phase
against the device), whether it fits (``check_fits``), the cheapest fixes when it does not, and
``sharding=auto``'s choice."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Optional

from ..config import (
    CheckpointingConfig,
    ClusterConfig,
    Config,
    DataConfig,
    PrecisionConfig,
    ShardingConfig,
    TrainConfig,
    model_preset,
)
from ..spec import PRECISION_POLICIES, ConfigError, RunSpec, build_spec
from ..strategies import AUTO, AUTO_ORDER, LEAST_MEMORY, STRATEGIES, mesh_for
from .adapters import adapter_lines, adapter_state_labels
from .adapters import flops_per_token as adapter_flops
from .device import GB, device_capacity_bytes, peak_flops
from .host import host_capacity_bytes, load_peak_bytes
from .memory import Memory, memory_breakdown, phase_peaks
from .optimizer import describe as describe_optimizer
from . import preference
from .shapes import count_params, flops_per_token, n_matmul

log = logging.getLogger("llama_fsdp.plan")

GIB = 2**30
DEFAULT_MARGIN = 0.10  # keep 10% of the device free (allocator fragmentation, CUDA context)
DEFAULT_MFU = 0.40


class PlanError(ValueError):
    """The run does not fit on its devices; the message has the numbers and the fixes."""


@dataclass(frozen=True)
class Plan:
    """What one run needs per device, and what it should achieve."""

    spec: RunSpec
    num_params: int
    n_matmul: int
    flops_per_token: float
    memory: Memory
    capacity_bytes: int
    capacity_source: str
    peak_flops: Optional[float]
    margin: float = DEFAULT_MARGIN
    mfu: float = DEFAULT_MFU
    # phase_peaks(spec, gloo=spec.device == "cpu"); make_plan fills it, computed if left empty
    phases: dict[str, int] = dataclasses.field(default_factory=dict)
    # host RAM per rank while the weights go in (plan/host.py), and what one rank may use
    # (None: not known)
    host_load_bytes: int = 0
    host_capacity_bytes: Optional[int] = None
    host_capacity_source: str = ""

    def __post_init__(self) -> None:
        if not self.phases:
            object.__setattr__(self, "phases",
                               phase_peaks(self.spec, gloo=self.spec.device == "cpu"))

    @property
    def peak_phase(self) -> str:
        """The phase of the step where the predicted peak is."""
        return max(self.phases, key=self.phases.get)

    @property
    def predicted_peak_bytes(self) -> int:
        """The largest phase peak (not memory.total, which adds what is never live at once)."""
        return self.phases[self.peak_phase]

    @property
    def predicted_peak_gb(self) -> float:
        """Decimal GB, comparable with the worker's peak_memory_gb metric."""
        return self.predicted_peak_bytes / GB

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.predicted_peak_bytes

    @property
    def usable_bytes(self) -> int:
        """Capacity less the safety margin."""
        return int(self.capacity_bytes * (1 - self.margin))

    @property
    def host_peak_bytes(self) -> int:
        """Host RAM one rank needs: while loading, or all through with sharding.cpu_offload
        (a CPU run's training state is its device memory, checked as such)."""
        return max(self.host_load_bytes, self.memory.host)

    @property
    def host_fits(self) -> bool:
        return (self.host_capacity_bytes is None
                or self.host_peak_bytes <= int(self.host_capacity_bytes * (1 - self.margin)))

    @property
    def fits(self) -> bool:
        return self.predicted_peak_bytes <= self.usable_bytes and self.host_fits

    @property
    def tokens_per_device_step(self) -> int:
        t = self.spec.train
        return t.batch_size * t.grad_accum * t.seq_len

    def tokens_per_s_per_device(self, mfu: Optional[float] = None) -> Optional[float]:
        """Throughput at the given MFU (default: the plan's), if the peak FLOP/s is known."""
        if self.peak_flops is None:
            return None
        return (mfu or self.mfu) * self.peak_flops / self.flops_per_token

    def step_time_s(self, mfu: Optional[float] = None) -> Optional[float]:
        """Seconds per optimizer step at the given MFU, if the peak FLOP/s is known."""
        tps = self.tokens_per_s_per_device(mfu)
        return None if tps is None else self.tokens_per_device_step / tps

    def metrics(self) -> dict[str, float]:
        """Numbers to log with the run (MLflow params / metrics)."""
        out = {"predicted_peak_memory_gb": round(self.predicted_peak_gb, 3),
               "plan_device_capacity_gb": round(self.capacity_bytes / GB, 3),
               "plan_num_params": float(self.num_params),
               "plan_flops_per_token": self.flops_per_token,
               "plan_host_peak_gb": round(self.host_peak_bytes / GB, 3)}
        if (step := self.step_time_s()) is not None:
            out[f"plan_step_time_s_at_{round(self.mfu * 100)}pct_mfu"] = step
        return out

    def table(self) -> str:
        return _table(self)


def make_plan(spec: RunSpec, *, mfu: float = DEFAULT_MFU, margin: float = DEFAULT_MARGIN) -> Plan:
    """Parameters, FLOPs per token and per-device memory of a run, against its device."""
    capacity, source = device_capacity_bytes(spec)
    flops = (adapter_flops(spec.model, spec.finetune, spec.train.seq_len)
             if spec.finetune.adapters else flops_per_token(spec.model, spec.train.seq_len))
    flops += preference.reference_flops_per_token(spec)  # objective=dpo's reference forward
    memory = memory_breakdown(spec)
    host, host_source = host_capacity_bytes(spec)
    return Plan(spec=spec, num_params=count_params(spec.model), n_matmul=n_matmul(spec.model),
                flops_per_token=flops,
                memory=memory, capacity_bytes=capacity, capacity_source=source,
                peak_flops=peak_flops(spec), margin=margin, mfu=mfu,
                phases=phase_peaks(spec, gloo=spec.device == "cpu"),
                host_load_bytes=load_peak_bytes(spec, memory.params),
                host_capacity_bytes=host, host_capacity_source=host_source)


def _rows(plan: Plan) -> list[tuple[str, int]]:
    s, mem = plan.spec, plan.memory
    p, t, ac = s.policy, s.train, s.checkpointing
    where = "sharded, offloaded to host" if s.sharding.cpu_offload else "sharded"
    ac_text = ac.mode + (f", every {ac.every_k}" if ac.mode == "selective" else "")
    state = (adapter_state_labels(s, where) if s.finetune.adapters else
             [f"parameters ({where}, {p.param_dtype})", f"gradients ({where}, {p.param_dtype})",
              f"optimizer ({describe_optimizer(s)})"])
    return [
        (state[0], mem.params),
        (state[1], mem.grads),
        (state[2], mem.optimizer),
        (f"unsharded params kept fwd->bwd ({p.compute_dtype})", mem.unsharded_params),
        ("all-gather / reduce-scatter buffers", mem.comm_buffers),
        (f"activations (b={t.batch_size}, s={t.seq_len}, AC {ac_text})", mem.activations),
        ("logits + fp32 loss (b x s x vocab)", mem.logits_loss),
    ]


def _table(plan: Plan) -> str:
    s = plan.spec
    mesh = " x ".join(f"{n}={v}" for n, v in zip(s.mesh.dim_names, s.mesh.shape))
    lines = [
        f"plan: model={s.model.name} strategy={s.strategy} ({mesh}, reshard_after_forward="
        f"{s.mesh.reshard_after_forward}) precision={s.precision.name} device={s.device} "
        f"world={s.world_size}",
        f"parameters   {plan.num_params:,} (N_matmul {plan.n_matmul:,})",
        *adapter_lines(s),
        *preference.plan_lines(s),
        f"FLOPs/token  {plan.flops_per_token / 1e9:.2f} GFLOP ("
        + ("4*N_matmul + 6*N_adapters" if s.finetune.adapters else "6*N_matmul")
        + f" + 12*L*H*Q*T, T={s.train.seq_len})",
        f"{'per-device memory':<52}{'GB':>10}{'GiB':>10}",
    ]
    rows = _rows(plan) + [("sum (never all live at once)", plan.memory.total)]
    lines += [f"  {name:<50}{b / GB:>10.2f}{b / GIB:>10.2f}" for name, b in rows]
    comm = "gloo" if s.device == "cpu" else "NCCL"
    lines.append(f"{'peak by phase (live at once, ' + comm + ')':<52}{'GB':>10}{'GiB':>10}")
    peak = plan.peak_phase
    lines += [f"  {name + (' <- peak' if name == peak else ''):<50}{b / GB:>10.2f}"
              f"{b / GIB:>10.2f}" for name, b in plan.phases.items()]
    rows = [(f"predicted peak (max over phases: {peak})", plan.predicted_peak_bytes),
            (f"capacity ({plan.capacity_source})", plan.capacity_bytes),
            ("headroom", plan.headroom_bytes)]
    lines += [f"  {name:<50}{b / GB:>10.2f}{b / GIB:>10.2f}" for name, b in rows]
    verdict = "fits" if plan.predicted_peak_bytes <= plan.usable_bytes else "DOES NOT FIT"
    lines.append(f"  {verdict} with a {plan.margin:.0%} margin (usable "
                 f"{plan.usable_bytes / GB:.2f} GB)")
    lines += _host_lines(plan)
    if (tps := plan.tokens_per_s_per_device()) is not None:
        lines.append(f"at {plan.mfu:.0%} MFU of {plan.peak_flops / 1e12:.0f} TFLOP/s: "
                     f"{tps:,.0f} tokens/s per device, {plan.step_time_s():.3f} s per step "
                     f"({plan.tokens_per_device_step:,} tokens per device)")
    return "\n".join(lines)


def _host_lines(plan: Plan) -> list[str]:
    """Host RAM per rank: loading, cpu offload's state, and against what the host has."""
    rows = [("host RAM per rank while loading the weights", plan.host_load_bytes)]
    if plan.memory.host:
        rows.append(("host RAM per rank (cpu offload)", plan.memory.host))
    if plan.host_capacity_bytes is not None:
        rows.append((f"host capacity ({plan.host_capacity_source})", plan.host_capacity_bytes))
    lines = [f"  {name:<50}{b / GB:>10.2f}{b / GIB:>10.2f}" for name, b in rows]
    if plan.host_capacity_bytes is None:
        lines.append(f"  host RAM not checked ({plan.host_capacity_source})")
    elif not plan.host_fits:
        lines.append(f"  host RAM DOES NOT FIT with a {plan.margin:.0%} margin")
    return lines


# ---------------------------------------------------------------------------------------------
# Variants of a spec (strategy, nodes, precision, AC, offload) and what fits


def with_strategy(spec: RunSpec, strategy: str) -> RunSpec:
    """The spec with another sharding strategy and its mesh; raise ConfigError if invalid."""
    shard_size = spec.sharding.shard_size if STRATEGIES[strategy].hybrid else None
    problems: list[str] = []
    mesh = mesh_for(strategy, shard_size, spec.world_size, spec.nproc_per_node, problems)
    problems += _nf4_problems(spec, mesh.shard)
    if problems:
        raise ConfigError(problems)
    name = spec.run_name
    if spec.tracking.run_name is None:  # the generated name carries the strategy
        prefix = f"{spec.model.name} "
        name = name.replace(f"{prefix}{spec.strategy} ", f"{prefix}{strategy} ", 1)
    return dataclasses.replace(
        spec, strategy=strategy, mesh=mesh, run_name=name,
        sharding=dataclasses.replace(spec.sharding, strategy=strategy, shard_size=shard_size))


def _nf4_problems(spec: RunSpec, shard: int) -> list[str]:
    """qlora: the NF4 shapes against a shard group of ``shard`` ranks (nf4.py)."""
    if not spec.finetune.nf4:
        return []
    from ..nf4 import target_problems

    return target_problems(spec.finetune, spec.model, shard)


def _or_none(make: Callable[[], RunSpec]) -> Optional[RunSpec]:
    """A variant, or None where it is not a valid run (e.g. NF4 shapes over its shard group)."""
    try:
        return make()
    except ConfigError:
        return None


def with_nodes(spec: RunSpec, nodes: int) -> RunSpec:
    """The spec on another number of nodes (same ranks per node)."""
    world = nodes * spec.nproc_per_node
    problems: list[str] = []
    mesh = mesh_for(spec.strategy, spec.sharding.shard_size, world, spec.nproc_per_node, problems)
    problems += _nf4_problems(spec, mesh.shard)
    if problems:
        raise ConfigError(problems)
    batch = spec.train.batch_size * spec.train.grad_accum * world
    return dataclasses.replace(
        spec, cluster=dataclasses.replace(spec.cluster, nodes=nodes), nodes=nodes,
        world_size=world, mesh=mesh, global_batch=batch, tokens_per_step=batch * spec.train.seq_len)


def with_optim(spec: RunSpec, name: str) -> RunSpec:
    """The spec with another optimizer (its block size at the default)."""
    return dataclasses.replace(spec, optim=dataclasses.replace(spec.optim, name=name,
                                                                block_size=None))


def _lowbit_variants(spec: RunSpec) -> list[tuple[str, RunSpec]]:
    """Smaller optimizer moments than the spec's (8 bits, then 4), where the spec allows them
    (spec.optim_problems: not with sharding.cpu_offload, nor for adapters, whose state is
    small)."""
    if spec.sharding.cpu_offload or spec.finetune.adapters:
        return []
    smaller = {"adamw": ("adamw8bit", "adamw4bit"), "adamw8bit": ("adamw4bit",)}
    return [(f"optim={name} ({'8' if name == 'adamw8bit' else '4'}-bit AdamW moments)",
             with_optim(spec, name)) for name in smaller.get(spec.optim.name, ())]


def _variants(spec: RunSpec) -> list[tuple[str, RunSpec]]:
    """Single changes that lower memory, cheapest first, as (override text, spec)."""
    out: list[tuple[str, RunSpec]] = []
    least = _or_none(lambda: with_strategy(spec, LEAST_MEMORY))
    if spec.strategy != LEAST_MEMORY and spec.world_size > 1 and least is not None:
        out.append((f"sharding={LEAST_MEMORY}", least))
    if spec.checkpointing.mode != "full":
        ck = dataclasses.replace(spec.checkpointing, mode="full")
        out.append(("checkpointing=full", dataclasses.replace(spec, checkpointing=ck)))
    if spec.train.batch_size > 1:
        t = dataclasses.replace(spec.train, batch_size=1,
                                grad_accum=spec.train.grad_accum * spec.train.batch_size)
        out.append((f"train.batch_size=1 train.grad_accum={t.grad_accum}",
                    dataclasses.replace(spec, train=t)))
    if spec.precision.name != "bf16":
        out.append(("precision=bf16 (bf16 params, grads and optimizer state)",
                    dataclasses.replace(spec, precision=PrecisionConfig(name="bf16"),
                                        policy=PRECISION_POLICIES["bf16"])))
    out += _lowbit_variants(spec)
    if (spec.device == "cuda" and not spec.sharding.cpu_offload and not spec.mesh.ddp
            and not spec.finetune.nf4):  # (qlora does not offload: spec.py)
        sh = dataclasses.replace(spec.sharding, cpu_offload=True)
        out.append(("sharding.cpu_offload=true", dataclasses.replace(spec, sharding=sh)))
    return out


def nodes_needed(spec: RunSpec, *, max_nodes: int = 1024) -> Optional[int]:
    """Fewest nodes above spec.nodes (same ranks per node) where it fits fully sharded."""
    base = _or_none(lambda: with_strategy(spec, LEAST_MEMORY))
    if base is None:
        return None
    for nodes in range(spec.nodes + 1, max_nodes + 1):
        more = _or_none(lambda: with_nodes(base, nodes))
        if more is not None and make_plan(more).fits:
            return nodes
    return None


def _combined(spec: RunSpec) -> tuple[str, RunSpec]:
    """Full sharding, full activation checkpointing, micro-batch 1 and bf16 together (the
    optimizer as it is: _fixes adds low-bit moments to this when it is not enough)."""
    texts = [text.split(" (")[0] for text, _ in _variants(spec)
             if text != "sharding.cpu_offload=true" and not text.startswith("optim=")]
    t = dataclasses.replace(spec.train, batch_size=1,
                            grad_accum=spec.train.grad_accum * spec.train.batch_size)
    least = _or_none(lambda: with_strategy(spec, LEAST_MEMORY)) if spec.world_size > 1 else None
    combo = dataclasses.replace(
        least or spec,
        checkpointing=dataclasses.replace(spec.checkpointing, mode="full"), train=t,
        precision=PrecisionConfig(name="bf16"), policy=PRECISION_POLICIES["bf16"])
    return " ".join(texts), combo


def _fixes(spec: RunSpec) -> list[str]:
    """Cheapest first: more nodes, then single config changes, then all of them together."""
    lines = []
    if spec.device == "cuda" and (n := nodes_needed(spec)) is not None:
        p = make_plan(with_nodes(with_strategy(spec, LEAST_MEMORY), n))
        lines.append(f"cluster=slurm cluster.nodes={n} sharding={LEAST_MEMORY} "
                     f"({n * spec.nproc_per_node} ranks): {p.predicted_peak_gb:.1f} GB (fits)")
    now = make_plan(spec).predicted_peak_bytes
    # (4-bit moments can peak above 8-bit ones: the step's temporary; listed only if lower)
    singles = [(text, p) for text, p in ((t, make_plan(v)) for t, v in _variants(spec))
               if not text.startswith("optim=") or p.predicted_peak_bytes < now]
    lines += [f"{text}: {p.predicted_peak_gb:.1f} GB" + _verdict(p, " (not enough alone)")
              for text, p in singles]
    if not any(p.fits for _, p in singles):
        text, combo = _combined(spec)
        p = make_plan(combo)
        # all of them together, unless that is one change already listed (or none at all)
        if text and text not in {t.split(" (")[0] for t, _ in singles}:
            lines.append(f"{text}: {p.predicted_peak_gb:.1f} GB" + _verdict(p, " (not enough)"))
        # ... with low-bit moments too (8 bits first; alone they are singles above); more
        # nodes keep the optimizer as it is
        for low_text, low in ([] if p.fits or not text else _lowbit_variants(combo)):
            low_plan = make_plan(low)
            lines.append(f"{text} {low_text.split(' (')[0]}".strip()
                         + f": {low_plan.predicted_peak_gb:.1f} GB"
                         + _verdict(low_plan, " (not enough)"))
            if low_plan.fits:
                break
        if not p.fits and spec.device == "cuda" and (n := nodes_needed(combo)) is not None:
            peak = make_plan(with_nodes(combo, n)).predicted_peak_gb
            lines.append(f"{text + ' ' if text else ''}cluster=slurm cluster.nodes={n} "
                         f"({n * spec.nproc_per_node} ranks): {peak:.1f} GB (fits)")
    return lines + _method_fixes(spec)


def _verdict(plan: Plan, short: str) -> str:
    """A fix's verdict: fits, fits the devices but not the host RAM, or ``short``."""
    if plan.fits:
        return " (fits)"
    if plan.predicted_peak_bytes <= plan.usable_bytes:
        return (f" (fits the devices, not the host RAM: {plan.host_peak_bytes / GB:.1f} GB per "
                "rank)")
    return short


def with_method(spec: RunSpec, method: str) -> RunSpec:
    """The spec with another finetune.method (its adapter options as they are)."""
    return dataclasses.replace(spec, finetune=dataclasses.replace(spec.finetune, method=method))


def _method_fixes(spec: RunSpec) -> list[str]:
    """Adapters instead of training every weight (lora, then qlora where the NF4 shapes shard
    over this group), alone and, where that is not enough, with the other changes together."""
    from ..nf4 import target_problems

    lines = []
    # adapters train with AdamW (spec.py refuses low-bit moments with them): say so
    optim = " optim=adamw" if spec.optim.lowbit else ""
    for method in {"full": ("lora", "qlora"), "lora": ("qlora",)}.get(spec.finetune.method, ()):
        v = with_method(with_optim(spec, "adamw") if optim else spec, method)
        if method == "qlora" and (spec.sharding.cpu_offload
                                  or target_problems(v.finetune, v.model, v.mesh.shard)):
            continue
        p = make_plan(v)
        lines.append(f"finetune={method}{optim} (adapters on a frozen"
                     + (" NF4" if method == "qlora" else "") + f" base): "
                     f"{p.predicted_peak_gb:.1f} GB" + _verdict(p, " (not enough alone)"))
        text, combo = _combined(v)
        if not p.fits and text:
            p = make_plan(combo)
            lines.append(f"finetune={method}{optim} {text}: {p.predicted_peak_gb:.1f} GB"
                         + _verdict(p, " (not enough)"))
        if p.fits:
            break
    return lines


def fixes_text(spec: RunSpec, plan: Plan) -> str:
    """Why the run does not fit, and the cheapest fixes with their predicted peaks."""
    if plan.predicted_peak_bytes <= plan.usable_bytes:  # the devices fit, the host does not
        return _host_text(spec, plan)
    head = (f"{spec.model.name} with sharding={spec.strategy} precision={spec.precision.name} "
            f"checkpointing={spec.checkpointing.mode} on {spec.world_size} {spec.device} rank(s) "
            f"needs {plan.predicted_peak_gb:.1f} GB per device, but {plan.usable_bytes / GB:.1f} "
            f"GB is usable ({plan.capacity_bytes / GB:.1f} GB from {plan.capacity_source}, less "
            f"a {plan.margin:.0%} margin).")
    fixes = "\n".join(f"  - {f}" for f in _fixes(spec)) or (
        "  - none left in this config: every memory-saving setting is on; it needs devices "
        "with more memory, or more of them")
    return f"{head}\nCheapest fixes (predicted peak per device):\n{fixes}"


def _host_text(spec: RunSpec, plan: Plan) -> str:
    """The host RAM a rank needs beyond what the host has, and what lowers it."""
    usable = int((plan.host_capacity_bytes or 0) * (1 - plan.margin))
    what = ("sharding.cpu_offload's parameters, gradients and optimizer state"
            if plan.memory.host >= plan.host_load_bytes else "loading the weights")
    fixes = []
    if spec.sharding.cpu_offload:
        p = make_plan(dataclasses.replace(
            spec, sharding=dataclasses.replace(spec.sharding, cpu_offload=False)))
        fixes.append(f"sharding.cpu_offload=false: {p.predicted_peak_gb:.1f} GB per device"
                     + ("" if p.fits else " (does not fit the devices)"))
    fixes.append("more nodes (cluster.nodes) or fewer ranks per node: each rank's share of "
                 "the host grows")
    if spec.cluster.kind == "slurm":
        fixes.append("a larger cluster.mem_gb, if the nodes have it")
    return (f"{spec.model.name} on {spec.world_size} rank(s) needs "
            f"{plan.host_peak_bytes / GB:.1f} GB of host RAM per rank for {what}, but "
            f"{usable / GB:.1f} GB is usable ({(plan.host_capacity_bytes or 0) / GB:.1f} GB from "
            f"{plan.host_capacity_source}, less a {plan.margin:.0%} margin).\nFixes:\n"
            + "\n".join(f"  - {f}" for f in fixes))


def check_fits(spec: RunSpec, plan: Optional[Plan] = None) -> None:
    """Raise PlanError if the run cannot fit its devices (unless spec.force); log the verdict."""
    plan = plan or make_plan(spec)
    if plan.fits:
        log.info("plan: %.2f GB of %.2f GB per device fits", plan.predicted_peak_gb,
                 plan.capacity_bytes / GB)
        return
    if spec.force:
        log.warning("%s\nforce=true: launching anyway", fixes_text(spec, plan))
        return
    raise PlanError(f"{fixes_text(spec, plan)}\nOr set force=true to launch anyway.")


def _candidates(spec: RunSpec) -> list[str]:
    multi = spec.nodes > 1 or spec.sharding.shard_size is not None
    offload = spec.sharding.cpu_offload  # offload moves FSDP shards: no_shard has none
    return [s for s in AUTO_ORDER
            if (not STRATEGIES[s].hybrid or multi) and not (offload and STRATEGIES[s].ddp)]


def choose_strategy(spec: RunSpec) -> tuple[str, str]:
    """For sharding=auto: the least-communication strategy that fits, and why."""
    tried = []
    for strategy in _candidates(spec):
        try:
            plan = make_plan(with_strategy(spec, strategy))
        except ConfigError:
            continue
        if plan.fits:
            skipped = "; ".join(tried)
            return strategy, (f"{strategy}: {plan.predicted_peak_gb:.1f} GB of "
                              f"{plan.usable_bytes / GB:.1f} GB usable per device"
                              + (f" (did not fit: {skipped})" if skipped else ""))
        tried.append(f"{strategy} {plan.predicted_peak_gb:.1f} GB")
    return LEAST_MEMORY, (f"{LEAST_MEMORY}: nothing fits ({'; '.join(tried)}); {LEAST_MEMORY} "
                          "needs the least memory")


def resolve_auto(spec: RunSpec) -> RunSpec:
    """Replace sharding=auto by the chosen strategy (other specs are returned unchanged)."""
    if spec.strategy != AUTO:
        return spec
    strategy, reason = choose_strategy(spec)
    log.info("sharding=auto -> %s", reason)
    return with_strategy(spec, strategy)


# ---------------------------------------------------------------------------------------------
# What-ifs without Hydra


def reference_spec(model: str, *, nodes: int = 1, gpus_per_node: int = 8, strategy: str = "full",
                   precision: str = "bf16", ac: str = "full", batch: int = 1, seq_len: int = 2048,
                   device_memory_gb: float = 80.0) -> RunSpec:
    """A SLURM GPU RunSpec built without Hydra, for tables and what-ifs."""
    cfg = Config(model=model_preset(model), sharding=ShardingConfig(strategy=strategy),
                 precision=PrecisionConfig(name=precision),
                 checkpointing=CheckpointingConfig(mode=ac),
                 cluster=ClusterConfig(kind="slurm", nodes=nodes, gpus_per_node=gpus_per_node,
                                       timeout_min=60, device_memory_gb=device_memory_gb),
                 data=DataConfig(), train=TrainConfig(batch_size=batch, seq_len=seq_len),
                 output_dir="outputs/plan", resume="none")
    return build_spec(cfg, output_dir="outputs/plan")
