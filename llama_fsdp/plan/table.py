"""The plan as a user reads it before launch (``render``): parameters, FLOPs, the components of
a step's memory, the peak by phase against the device, host RAM, the longest sequence that fits,
and the throughput at the plan's MFU."""
from __future__ import annotations

from ..config.schema import TrainConfig
from ..config.precision import DTYPE_BYTES
from ..run.spec import RunSpec
from .activations import checkpointed_inputs, saved_layer_bytes
from .device import GB
from .lora import adapter_params, lora_saved_layer_bytes, trainable_fraction
from .optimizer import describe as describe_optimizer
from .preference import plan_lines

# ``Plan`` below is fit.Plan, whose table() calls render(self): fit.py imports this module, so
# the name is not imported here (even a type-only import would make the two import each other).

GIB = 2**30


def _state_labels(s: RunSpec, where: str) -> list[str]:
    """The labels of params, grads and optimizer state (with a frozen base: its and the
    adapters')."""
    p, ft = s.policy, s.finetune
    if not ft.adapters:
        return [f"parameters ({where}, {p.param_dtype})", f"gradients ({where}, {p.param_dtype})",
                f"optimizer ({describe_optimizer(s)})"]
    base = f"NF4/{p.frozen_dtype}" if ft.nf4 else p.frozen_dtype
    return [f"base {base} + adapters {p.param_dtype} ({where})",
            f"gradients (adapters only, {p.param_dtype})",
            f"optimizer (AdamW 2 moments of the adapters, {p.param_dtype})"]


def _rows(plan: Plan) -> list[tuple[str, int]]:
    s, mem = plan.spec, plan.memory
    p, t, ac = s.policy, s.train, s.checkpointing
    where = "sharded, offloaded to host" if s.sharding.cpu_offload else "sharded"
    ac_text = ac.mode + (f", every {ac.every_k}" if ac.mode == "selective" else "")
    if checkpointed_inputs(ac, s.model.num_layers, s.device)[1]:
        ac_text += ", inputs offloaded"
    state = _state_labels(s, where)
    loss = ("logits + fp32 loss (b x s x vocab)" if t.loss == TrainConfig.FULL else
            f"loss, chunked ({t.loss_chunk} tokens x vocab a chunk)")
    return [
        (state[0], mem.params),
        (state[1], mem.grads),
        (state[2], mem.optimizer),
        (f"unsharded params kept fwd->bwd ({p.compute_dtype})", mem.unsharded_params),
        ("all-gather / reduce-scatter buffers", mem.comm_buffers),
        (f"activations (b={t.batch_size}, s={t.seq_len}, AC {ac_text})", mem.activations),
        (loss, mem.logits_loss),
        *([("CUDA workspaces (cuBLAS), every phase", mem.runtime)] if mem.runtime else []),
    ]


def _line(name: str, b: int) -> str:
    return f"  {name:<50}{b / GB:>10.2f}{b / GIB:>10.2f}"


def render(plan: Plan) -> str:
    s = plan.spec
    mesh = " x ".join(f"{n}={v}" for n, v in zip(s.mesh.dim_names, s.mesh.shape))
    lines = [
        f"plan: model={s.model.name} strategy={s.strategy} ({mesh}, reshard_after_forward="
        f"{s.mesh.reshard_after_forward}) precision={s.precision.name} device={s.device} "
        f"world={s.world_size}",
        f"parameters   {plan.num_params:,} (N_matmul {plan.n_matmul:,})",
        *_adapter_lines(s),
        *plan_lines(s),
        f"FLOPs/token  {plan.flops_per_token / 1e9:.2f} GFLOP ("
        + ("4*N_matmul + 6*N_adapters" if s.finetune.adapters else "6*N_matmul")
        + f" + 12*L*H*Q*T, T={s.train.seq_len})",
        f"{'per-device memory':<52}{'GB':>10}{'GiB':>10}",
    ]
    rows = _rows(plan) + [("sum (never all live at once)", plan.memory.total)]
    lines += [_line(name, b) for name, b in rows]
    comm = "gloo" if s.device == "cpu" else "NCCL"
    lines.append(f"{'peak by phase (live at once, ' + comm + ')':<52}{'GB':>10}{'GiB':>10}")
    peak = plan.peak_phase
    lines += [_line(name + (" <- peak" if name == peak else ""), b)
              for name, b in plan.phases.items()]
    rows = [(f"predicted peak (max over phases: {peak})", plan.predicted_peak_bytes),
            (f"capacity ({plan.capacity_source})", plan.capacity_bytes),
            ("headroom", plan.headroom_bytes)]
    lines += [_line(name, b) for name, b in rows]
    verdict = "fits" if plan.device_fits else "DOES NOT FIT"
    lines.append(f"  {verdict} with a {plan.margin:.0%} margin (usable "
                 f"{plan.usable_bytes / GB:.2f} GB)")
    lines += _host_lines(plan) + _sequence_lines(plan)
    if (tps := plan.tokens_per_s_per_device()) is not None:
        lines.append(f"at {plan.mfu:.0%} MFU of {plan.peak_flops / 1e12:.0f} TFLOP/s: "
                     f"{tps:,.0f} tokens/s per device, {plan.step_time_s():.3f} s per step "
                     f"({plan.tokens_per_device_step:,} tokens per device)")
    return "\n".join(lines)


def _adapter_lines(s: RunSpec) -> list[str]:
    """The line on what trains (nothing for full fine-tuning)."""
    ft = s.finetune
    if not ft.adapters:
        return []
    n = adapter_params(s.model, ft)
    return [f"trainable    {n:,} adapters ({trainable_fraction(s):.2%}): {ft.method} rank "
            f"{ft.rank} on {', '.join(ft.target_modules)}; the base is frozen"
            + (" and NF4" if ft.nf4 else "")]


def _host_lines(plan: Plan) -> list[str]:
    """Host RAM per rank: loading, the offloaded state and activations, and against what the
    host has."""
    mem = plan.memory
    rows = [("host RAM per rank while loading the weights", plan.host_load_bytes)]
    if mem.host:
        rows.append(("host RAM per rank (cpu offload)", mem.host))
    if mem.host_activations:
        rows.append(("host RAM per rank (activation offload, pinned)", mem.host_activations))
    if plan.host_capacity_bytes is not None:
        rows.append((f"host capacity ({plan.host_capacity_source})", plan.host_capacity_bytes))
    lines = [_line(name, b) for name, b in rows]
    if plan.host_capacity_bytes is None:
        lines.append(f"  host RAM not checked ({plan.host_capacity_source})")
    elif not plan.host_fits:
        lines.append(f"  host RAM DOES NOT FIT with a {plan.margin:.0%} margin")
    return lines


def recompute_bytes(s: RunSpec) -> int:
    """The full activations of the one layer backward recomputes at a time (0 without
    activation checkpointing)."""
    m, t = s.model, s.train
    if not s.checkpointing.wrapped_layers(m.num_layers):
        return 0
    c = DTYPE_BYTES[s.policy.compute_dtype]
    layer = (lora_saved_layer_bytes(m, s.finetune, seq_len=t.seq_len, c=c,
                                    packing=s.data.packing, device=s.device)
             if s.finetune.adapters else
             saved_layer_bytes(m, seq_len=t.seq_len, c=c, packing=s.data.packing,
                               device=s.device))
    return t.batch_size * t.seq_len * layer


def _sequence_lines(plan: Plan) -> list[str]:
    """The longest train.seq_len that fits, and what dominates the activations when their
    checkpointed inputs are offloaded."""
    s = plan.spec
    longest = plan.longest_seq_len
    cap = s.model.max_position_embeddings
    where = (" (model.max_position_embeddings)" if longest == cap else
             "" if longest else ": none (not even 128 tokens)")
    lines = [f"  longest train.seq_len that fits at b={s.train.batch_size}: {longest:,}{where}"]
    recompute = recompute_bytes(s)
    if checkpointed_inputs(s.checkpointing, s.model.num_layers, s.device)[1] and \
            recompute > plan.memory.activations / 2:
        lines.append(f"  one layer's recompute in backward ({recompute / GB:.2f} GB) is most of "
                     "the activations now: sequence-tiled recompute of its MLP would be the "
                     "next saving (docs/long_context.md)")
    return lines
