"""What objective=dpo adds to the plan: the reference beside the policy, its forward, and the
cached log-probs' size on disk (llama_fsdp/objective/dpo_reference.py has the three references).

The pair itself costs nothing apart: a row of train.seq_len tokens holds whole pairs (chosen and
rejected, each a document of its own), so the policy's forward and backward are the SFT phases
of the same rows (twice the sequences of an SFT run on the chosen answers alone, in the same
tokens), with the loss path's terms of the per-token log-probs (plan/loss.py's
``logprob_bytes``: fit.py's phase models read them for objective=dpo). Per reference
(objective.reference):

- model, with adapters: the policy with its adapters off, no_grad: nothing kept; its forward
  gathers the policy's own units and keeps no activations.
- model, full fine-tuning: a frozen copy in the compute dtype, sharded like the policy (a whole
  replica under no_shard), held through the step; its forward gathers two of its layers at once
  (one computing, one prefetched), each resharded after it.
- cached: nothing in memory; 4 bytes per sequence on disk (8 per pair).

The reference's forward runs before the step's forwards (all micro-batches' at once), when no
gradients are live (zero_grad(set_to_none) between steps), and it saves no activations: its
peak is bounded by the policy's forward phase, plus the copy's two gathered layers and its own
no-grad log-probs (plan/loss.py's ``reference_logprob_bytes``: with train.loss=full, the
logits). The bound is the "reference" phase; every other phase gains the copy's shards.
"""
from __future__ import annotations

from ..config.objectives import OBJECTIVES
from ..config.precision import DTYPE_BYTES
from ..config.schema import ObjectiveConfig
from ..run.spec import RunSpec
from .loss import reference_logprob_bytes
from .shapes import count_params, layer_shapes, n_matmul, numel, param_shapes, sharded_numel
from .phases import FORWARD, REFERENCE

NPY_HEADER = 128  # bytes before the values of each split's .npy file


def pairs(spec: RunSpec) -> bool:
    """The objective's rows hold preference pairs, and it compares them with a reference
    (config/objectives.py: dpo)."""
    return OBJECTIVES[spec.objective.name].pairs


def reference_copy(spec: RunSpec) -> bool:
    """A frozen copy of the model sits beside the policy (full fine-tuning, reference=model)."""
    o = spec.objective
    return pairs(spec) and o.reference == ObjectiveConfig.MODEL and not spec.finetune.adapters


def reference_bytes(spec: RunSpec) -> int:
    """Per-device bytes of the frozen copy's shards (0 without one)."""
    if not reference_copy(spec):
        return 0
    c = DTYPE_BYTES[spec.policy.frozen_dtype]
    if spec.mesh.ddp:
        return count_params(spec.model) * c
    return sharded_numel(param_shapes(spec.model), spec.mesh.shard) * c


def reference_forward_bytes(spec: RunSpec) -> int:
    """Beyond the policy's forward: the copy's two layers gathered at once (0 for adapters off,
    which gather the policy's own units, and under no_shard, where nothing is gathered)."""
    if not reference_copy(spec) or spec.mesh.ddp:
        return 0
    return 2 * numel(layer_shapes(spec.model)) * DTYPE_BYTES[spec.policy.compute_dtype]


def phase_peaks(spec: RunSpec, policy: dict[str, int]) -> dict[str, int]:
    """The policy's phases (``policy``: fit.py's, by the phase models), each with the copy's
    shards, and the reference's forward (bounded by the policy's forward phase: see the
    module's docstring); the policy's phases as they are for objective=sft."""
    if not pairs(spec):
        return policy
    held = reference_bytes(spec)
    out = {name: b + held for name, b in policy.items()}
    if spec.objective.reference == ObjectiveConfig.MODEL:
        out = {REFERENCE: out[FORWARD] + reference_forward_bytes(spec)
               + reference_logprob_bytes(spec), **out}
    return out


def reference_flops_per_token(spec: RunSpec) -> float:
    """The reference's forward per token: 2 N_matmul + 4 L H Q T (a third of 6 N + 12 L H Q T;
    adapters off: the base alone); 0 when cached."""
    if not pairs(spec) or spec.objective.reference == ObjectiveConfig.CACHED:
        return 0.0
    m = spec.model
    return 2.0 * n_matmul(m) + 4.0 * m.num_layers * m.hidden_size * spec.train.seq_len


def cache_bytes(pairs: int) -> int:
    """The cached reference's size on disk: one fp32 log-prob per sequence, two per pair, and
    the train and eval files' headers."""
    return 8 * pairs + 2 * NPY_HEADER


def plan_lines(spec: RunSpec) -> list[str]:
    """The plan table's lines about the objective (none for sft)."""
    o, d = spec.objective, spec.data
    if not pairs(spec):
        return []
    if o.reference == ObjectiveConfig.CACHED:
        where = "log-probs computed once, cached on disk (nothing in memory)"
    elif spec.finetune.adapters:
        where = "the policy with its adapters off (nothing added)"
    else:
        where = (f"a frozen copy sharded like the policy, {reference_bytes(spec) / 1e9:.2f} GB "
                 "per device")
    out = [f"objective    {o.name} ({o.loss}, beta {o.beta:g}): rows of {spec.train.seq_len} tokens "
           f"hold whole pairs, chosen and rejected each a document; reference: {where}"]
    if o.reference == ObjectiveConfig.MODEL:
        out.append("             its forward adds 2*N_matmul + 4*L*H*Q*T FLOPs per token "
                   f"({reference_flops_per_token(spec) / 1e9:.2f} GFLOP, counted above)")
    if o.reference == ObjectiveConfig.CACHED:
        size = (f", {cache_bytes(d.num_records) / 1e6:.3f} MB for the {d.num_records} training "
                "pairs" if d.name == "synthetic" else "")
        out.append(f"             reference cache on disk: 8 bytes per pair{size} "
                   "(cache_dir/reference/)")
    return out
