"""When a run does not fit: the cheapest changes that make it fit, each with its predicted peak
(``fixes_text``), and the refusal before launch (``check_fits``). Every change is a variant the
validator accepts (variants.py); none is listed that build_spec would refuse."""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

from ..config.schema import PrecisionConfig, TrainConfig
from ..config.optimizers import DEFAULT as DEFAULT_OPTIMIZER
from ..config.optimizers import OPTIMIZERS
from ..config.precision import PRECISION_POLICIES
from ..run.spec import RunSpec
from ..config.strategies import LEAST_MEMORY
from .harness import context_tokens
from .device import GB
from .fit import Plan, make_plan
from .search import nodes_needed
from .variants import (
    checked,
    or_none,
    with_checkpointing,
    with_method,
    with_nodes,
    with_optim,
    with_seq_len,
    with_strategy,
    with_train,
)

log = logging.getLogger("llama_fsdp.plan")


class PlanError(ValueError):
    """The run does not fit on its devices; the message has the numbers and the fixes."""


# A change: (its override text, the variant; None where it does not apply to this spec)
Change = tuple[str, Callable[[RunSpec], Optional[RunSpec]]]


def _least_memory(spec: RunSpec) -> Optional[RunSpec]:
    if spec.strategy == LEAST_MEMORY or spec.world_size == 1:
        return None
    return or_none(lambda: with_strategy(spec, LEAST_MEMORY))


def _full_ac(spec: RunSpec) -> Optional[RunSpec]:
    return None if spec.checkpointing.mode == "full" else with_checkpointing(spec, mode="full")


def _batch_one(spec: RunSpec) -> Optional[RunSpec]:
    t = spec.train
    if t.batch_size == 1:
        return None
    return with_train(spec, batch_size=1, grad_accum=t.grad_accum * t.batch_size)


def _bf16(spec: RunSpec) -> Optional[RunSpec]:
    if spec.precision.name == "bf16":
        return None
    return or_none(lambda: checked(dataclasses.replace(
        spec, precision=PrecisionConfig(name="bf16"), policy=PRECISION_POLICIES["bf16"])))


def _chunked_loss(spec: RunSpec) -> Optional[RunSpec]:
    return None if spec.train.loss == TrainConfig.CHUNKED else with_train(
        spec, loss=TrainConfig.CHUNKED)


def _offload_activations(spec: RunSpec) -> Optional[RunSpec]:
    """checkpointing.offload on CUDA (on CPU the inputs are host memory already)."""
    ac = spec.checkpointing
    if spec.device != "cuda" or ac.offload:
        return None
    return or_none(lambda: with_checkpointing(spec, offload=True,
                                              mode="full" if ac.mode == "none" else ac.mode))


def _cpu_offload(spec: RunSpec) -> Optional[RunSpec]:
    if spec.device != "cuda" or spec.sharding.cpu_offload:
        return None
    return or_none(lambda: checked(dataclasses.replace(
        spec, sharding=dataclasses.replace(spec.sharding, cpu_offload=True))))


def _offload_text(spec: RunSpec) -> str:
    return ("checkpointing.offload=true" if spec.checkpointing.mode != "none" else
            "checkpointing=full checkpointing.offload=true")


# Cheapest first. The combinable ones are applied together when no single one is enough.
COMBINABLE: list[Change] = [
    (f"sharding={LEAST_MEMORY}", _least_memory),
    ("checkpointing=full", _full_ac),
    ("train.batch_size=1", _batch_one),
    ("precision=bf16", _bf16),
    ("train.loss=chunked", _chunked_loss),
]


def _made(make: Callable[[RunSpec], Optional[RunSpec]], spec: RunSpec) -> Optional[RunSpec]:
    """A change applied to ``spec``: None where it does not apply or the validator refuses it."""
    return or_none(lambda: make(spec))


def _texts(spec: RunSpec, text: str, variant: RunSpec) -> str:
    """A change's override text with its consequences and explanation."""
    if text == "train.batch_size=1":
        return f"train.batch_size=1 train.grad_accum={variant.train.grad_accum}"
    if text == "precision=bf16":
        return "precision=bf16 (bf16 params, grads and optimizer state)"
    if text == "train.loss=chunked":
        return "train.loss=chunked (no b x s x vocab logits)"
    return text


def _lowbit_variants(spec: RunSpec) -> list[tuple[str, RunSpec]]:
    """Smaller optimizer moments than the spec's (8 bits, then 4), where the validator allows
    them."""
    have = OPTIMIZERS[spec.optim.name].moment_bits or 32
    smaller = sorted((o for o in OPTIMIZERS.values() if 0 < o.moment_bits < have),
                     key=lambda o: -o.moment_bits)
    out = []
    for o in smaller:
        if (v := or_none(lambda: with_optim(spec, o.name))) is not None:
            out.append((f"optim={o.name} ({o.moment_bits}-bit AdamW moments)", v))
    return out


def _variants(spec: RunSpec) -> list[tuple[str, RunSpec]]:
    """Single changes that lower memory, cheapest first, as (override text, spec)."""
    out = [(_texts(spec, text, v), v) for text, make in COMBINABLE
           if (v := _made(make, spec)) is not None]
    out += _lowbit_variants(spec)
    if (v := _offload_activations(spec)) is not None:
        out.append((_offload_text(spec), v))
    if (v := _cpu_offload(spec)) is not None:
        out.append(("sharding.cpu_offload=true", v))
    return out


def _combined(spec: RunSpec) -> tuple[str, RunSpec]:
    """Full sharding, full activation checkpointing, micro-batch 1, bf16 and the chunked loss
    together (the optimizer as it is: _fixes adds low-bit moments and offload to this when it
    is not enough)."""
    texts, combo = [], spec
    for text, make in COMBINABLE:
        if (v := _made(make, combo)) is not None:
            texts.append(text.split(" (")[0] if text != "train.batch_size=1" else
                         _texts(spec, text, v))
            combo = v
    return " ".join(texts), combo


def _verdict(plan: Plan, short: str) -> str:
    """A fix's verdict: fits, fits the devices but not the host RAM, or ``short``."""
    if plan.fits:
        return " (fits)"
    if plan.device_fits:
        return (f" (fits the devices, not the host RAM: {plan.host_peak_bytes / GB:.1f} GB per "
                "rank)")
    return short


def _more_nodes(spec: RunSpec, prefix: str = "") -> list[str]:
    if spec.device != "cuda" or (n := nodes_needed(spec)) is None:
        return []
    p = make_plan(with_nodes(with_strategy(spec, LEAST_MEMORY), n))
    return [f"{prefix}cluster=slurm cluster.nodes={n} sharding={LEAST_MEMORY} "
            f"({n * spec.nproc_per_node} ranks): {p.predicted_peak_gb:.1f} GB (fits)"]


def _fixes(spec: RunSpec, plan: Plan) -> list[str]:
    """Cheapest first: more nodes, then single config changes, then all of them together, then
    the longest sequence that fits as it is."""
    lines = _more_nodes(spec)
    now = plan.predicted_peak_bytes
    # (4-bit moments can peak above 8-bit ones: the step's temporary; listed only if lower)
    singles = [(text, p) for text, p in ((t, make_plan(v)) for t, v in _variants(spec))
               if not text.startswith("optim=") or p.predicted_peak_bytes < now]
    lines += [f"{text}: {p.predicted_peak_gb:.1f} GB" + _verdict(p, " (not enough alone)")
              for text, p in singles]
    if not any(p.fits for _, p in singles):
        lines += _together(spec, {t.split(" (")[0] for t, _ in singles})
    if 0 < plan.longest_seq_len < spec.train.seq_len:
        lines.append(f"train.seq_len={plan.longest_seq_len} (the longest that fits as "
                     "configured)")
    return lines + _method_fixes(spec)


def _together(spec: RunSpec, listed: set[str]) -> list[str]:
    """The combinable changes all together; then with low-bit moments, activation offload,
    more nodes, until one fits."""
    text, combo = _combined(spec)
    p = make_plan(combo)
    lines = []
    # all of them together, unless that is one change already listed (or none at all)
    if text and text not in listed:
        lines.append(f"{text}: {p.predicted_peak_gb:.1f} GB" + _verdict(p, " (not enough)"))
    if p.fits or not text:
        return lines
    extra = _lowbit_variants(combo)
    if (v := _offload_activations(combo)) is not None:
        extra.append((_offload_text(combo), v))
    fitted = False
    for more_text, more in extra:  # 8 bits first; then offload
        more_plan = make_plan(more)
        lines.append(f"{text} {more_text.split(' (')[0]}".strip()
                     + f": {more_plan.predicted_peak_gb:.1f} GB"
                     + _verdict(more_plan, " (not enough)"))
        if fitted := more_plan.fits:
            break
    if not fitted and 0 < (longest := p.longest_seq_len) < spec.train.seq_len:
        lines.append(f"{text} train.seq_len={longest} (the longest that fits with them)")
    return lines + _more_nodes(combo, prefix=f"{text} ")


def _method_fixes(spec: RunSpec) -> list[str]:
    """Adapters instead of training every weight (lora, then qlora where the validator allows
    it), alone and, where that is not enough, with the other changes together."""
    lines = []
    # adapters train with AdamW (the validator refuses low-bit moments with them): say so
    optim = f" optim={DEFAULT_OPTIMIZER}" if spec.optim.lowbit else ""
    for method in {"full": ("lora", "qlora"), "lora": ("qlora",)}.get(spec.finetune.method, ()):
        v = or_none(lambda: with_method(with_optim(spec, DEFAULT_OPTIMIZER) if optim else spec,
                                        method))
        if v is None:
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
    if plan.device_fits:  # the devices fit, the host does not
        return _host_text(spec, plan)
    if plan.peak_phase == "harness":
        return _harness_text(spec, plan)
    head = (f"{spec.model.name} with sharding={spec.strategy} precision={spec.precision.name} "
            f"checkpointing={spec.checkpointing.mode} on {spec.world_size} {spec.device} rank(s) "
            f"needs {plan.predicted_peak_gb:.1f} GB per device, but {plan.usable_bytes / GB:.1f} "
            f"GB is usable ({plan.capacity_bytes / GB:.1f} GB from {plan.capacity_source}, less "
            f"a {plan.margin:.0%} margin).")
    fixes = "\n".join(f"  - {f}" for f in _fixes(spec, plan)) or (
        "  - none left in this config: every memory-saving setting is on; it needs devices "
        "with more memory, or more of them")
    return f"{head}\nCheapest fixes (predicted peak per device):\n{fixes}"


def _harness_text(spec: RunSpec, plan: Plan) -> str:
    """eval.harness loads the whole exported model on rank 0's device: the training fits, the
    harness does not."""
    h = spec.eval.harness
    train_peak = max(v for k, v in plan.phases.items() if k != "harness")
    fixes = [f"eval.harness.batch_size=1 or eval.harness.max_length=<shorter> (planned at "
             f"{h.batch_size} x {context_tokens(spec)} tokens)"]
    if h.every_steps:
        fixes.insert(0, "eval.harness.every_steps=0 (only at the end, after the training "
                        "state is freed)")
    return (f"eval.harness.tasks={list(h.tasks)} load the whole exported {spec.model.name} "
            f"on rank 0's device: {plan.predicted_peak_gb:.1f} GB, but "
            f"{plan.usable_bytes / GB:.1f} GB is usable ({plan.capacity_source}); the training "
            f"alone fits ({train_peak / GB:.1f} GB). Fixes: " + "; ".join(fixes)
            + "; or train without eval.harness.tasks and score the export where it fits: "
              "python -m llama_fsdp.evaluate <run dir> --tasks ... on a larger device, or "
              "lm_eval with --model vllm / --model_args parallelize=True across GPUs")


def _host_text(spec: RunSpec, plan: Plan) -> str:
    """The host RAM a rank needs beyond what the host has, and what lowers it."""
    usable = int((plan.host_capacity_bytes or 0) * (1 - plan.margin))
    mem = plan.memory
    what = ("loading the weights" if plan.host_load_bytes >= mem.host + mem.host_activations
            else " and ".join(w for w, b in (
                ("sharding.cpu_offload's parameters, gradients and optimizer state", mem.host),
                ("checkpointing.offload's layer inputs", mem.host_activations)) if b))
    fixes = []
    for text, on, change in (
            ("sharding.cpu_offload=false", spec.sharding.cpu_offload,
             lambda: dataclasses.replace(spec, sharding=dataclasses.replace(
                 spec.sharding, cpu_offload=False))),
            ("checkpointing.offload=false", spec.checkpointing.offload,
             lambda: with_checkpointing(spec, offload=False))):
        if on:
            p = make_plan(change())
            fixes.append(f"{text}: {p.predicted_peak_gb:.1f} GB per device"
                         + ("" if p.device_fits else " (does not fit the devices)"))
    if mem.host_activations and 0 < plan.longest_seq_len < spec.train.seq_len:
        fixes.append(f"train.seq_len={plan.longest_seq_len} (the longest that fits as "
                     "configured)")
    fixes.append("more nodes (cluster.nodes) or fewer ranks per node: each rank's share of "
                 "the host grows")
    if spec.placement.more_ram:
        fixes.append(spec.placement.more_ram)
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
