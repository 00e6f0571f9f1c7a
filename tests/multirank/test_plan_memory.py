"""The planner's predicted peak against the memory real CPU gloo ranks allocate in a step.

Measured per rank by benchmarks/plan_vs_measured.py: a malloc shim, LD_PRELOADed into the
ranks, tracks the live heap blocks of >= 64 KiB in every thread (every tensor of that size, and
gloo's buffers); hooks read the high-water mark of each phase of the second training step (the
first with optimizer state). Each case first runs one throw-away step of its own shapes
(plan_vs_measured.warm_up), so MKL's buffer pool and oneDNN's primitive cache and scratchpad,
whose sizes depend on the CPU's kernels (5-9 MB on an AMD EPYC, 23 MB on another machine), are
already in the baseline: the measured peaks are tensors alone on any CPU, and what a case leaves
behind once its model and optimizer are deleted is a leak, asserted to be nothing.

Tolerances, each the claim it checks (per case: ``band``), from
benchmarks/plan_vs_measured_cpu.md:
- plan.predicted_peak_bytes is the per-phase model (llama_fsdp.plan.phase_peaks: max over
  forward / loss / layers / root / optimizer of what is live in each, with gloo's reduce-scatter
  copy on CPU; an untied model in torchtitan's FSDP groups, parallel.apply_fsdp, has its own
  terms). With AdamW it tracks the measured peak within 10% (0.921 to 1.006 in the sweep):
  measured within [0.88, 1.02] x predicted; 2% above for allocator rounding, 12% below because
  the model counts in full what gloo frees at a varying moment on its worker thread (its
  reduce-scatter scratch, the root's all-gather output): run to run, those move single configs
  by up to 5%.
- With low-bit moments (compiled or eager: the step's fp32 copies of the largest parameter are
  the plan's constants, measured here) or LoRA / QLoRA adapters, README.md states the plan is
  within 3.5% of the measured peak: measured within [0.965, 1.035] x predicted (the sweep:
  0.967 to 1.014).
- The one exception README.md names, the tied 4-rank 8-bit config, over-predicted by 12% (its
  layers phase, 0.882 in the sweep): measured within [0.85, 1.02] x predicted, over-predicted by
  at most 15% and never under.
- plan.memory.total, the sum of the components (never all live together: grads, all-gather /
  reduce-scatter buffers of 2 layers + the largest unit, the recomputed layer beside the loss
  buffers), stays an upper bound: measured <= sum (the sweep's worst is 0.934), and not
  absurdly loose: measured >= 0.55 x sum (worst 0.599, full sharding with AC on at
  micro-batch 1, where those transients weigh most and the grouping keeps the head and the
  embedding from being gathered together). Not for an eager low-bit step: the sum has no term
  for the step's temporaries, and its 14 fp32 copies of the largest parameter take the peak
  over the sum (measured 1.174 x sum); the phase model counts them, and that row is checked
  against it alone.
- At the start of the second step the heap holds exactly the sharded params and the optimizer
  state the plan counts (within 1 MB + 1%), and for no_shard (DDP) the gradient buckets; with
  finetune=lora / qlora the frozen base and the adapters' moments. State in tensors below the
  shim's 64 KiB blocks (adapters, NF4 shards, low-bit moments' scales and code tables, the
  norms' moments) is measured on the ranks and added (measure_case's ``small``).

Without a C compiler the test skips; CI sets LLAMA_FSDP_REQUIRE_MEMTRACK=1 (.ci/run), which
makes that a failure, as LLAMA_FSDP_REQUIRE_SLURM / _UI do for the SLURM and UI tests.
"""
from __future__ import annotations

import os

import pytest

from benchmarks import plan_vs_measured as B
from tests.conftest import make_spec
from tests.distributed import run_ranks

# hang guards, not speed checks: world 2's 17 cases took 210 s in a CI run, 620 s beside the
# GPU-check rehearsal (pyproject's 600 s per test cut it off there)
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(1500)]

MB = 10**6
MAX_LEFTOVER = MB // 2  # a leak of any sharded tensor here is larger
PLAN_LOOSEST = 0.55
# measured / predicted (the module docstring says where each claim is made)
ADAMW_BAND = (0.88, 1.02)
LOWBIT_OR_ADAPTERS_BAND = (0.965, 1.035)
TIED_4_RANK_8BIT = (4, ("full", "fp32", "full", 1, True, 1, "", "adamw8bit"))
TIED_4_RANK_8BIT_BAND = (0.85, 1.02)
# (strategy, precision, activation checkpointing, micro-batch[, tied embedding, grad_accum,
# packed, optimizer, finetune method]): every strategy, AC none, selective and full, fp32 /
# bf16 / mixed, micro-batch 1, 2 and 4; no_shard (DDP) in fp32 and under autocast (mixed); packed records through SDPA's dense
# mask (a compute-dtype b x s x s copy and k/v repeated to every head, saved per layer: +3% of
# the peak here, so a plan without packed_mask_bytes is out of the band) and through the CPU
# default attention (varlen's block-sparse SDPA: its chunks' outputs beside their concatenation,
# and the chunks' masks). The peaks are in the loss phase, except "full, mixed, AC full, b=1"
# (here with the chunked loss), DDP's and the low-bit ones', the first
# one's in the root's reduce-scatter at the end of backward with gloo's copy of its input
# (without that copy, which the plan counts on CPU only, the prediction is 7% under the
# measured peak: out of the band).
# Low-bit AdamW moments, peaking in the optimizer step with 4-bit moments, compiled and eager
# (optim.eager: a step that makes more fp32 copies of the largest parameter); the tied 4-rank
# 8-bit row, the plan's loosest. Three compiled steps, one per shard layout that adds a
# constant: 4-bit on 2 ranks (STEP_FP32_COPIES[4]), 8-bit on DDP's plain tensors and the tied
# 4-rank 8-bit row (STEP_FP32_COPIES[8]). The hybrid 4-bit row steps eagerly: its local shards
# are the 2-rank row's (shard_size=2), so compiling it checks that constant a second time, for
# 60-80 s of CPU (each compiled layout costs that much: dynamo, inductor and gcc).
# finetune=lora / qlora: a frozen base (plan/lora.py), its peaks in the loss phase.
# train.loss=chunked (llama_fsdp/objective/loss.py; the rest pin train.loss=full, as the sweep was first
# measured): FSDP in bf16 beside its full-loss twin (CHUNKED_PAIR: the measured peak drops as
# planned), DDP under autocast, tied with accumulation, hybrid, qlora with
# checkpointing.offload (a plain copy on CPU).
CHUNKED = ("", "", "full", "chunked")
CHUNKED_PAIR = (2, "full", "bf16", "none", 2)
CASES = {
    2: [("full", "fp32", "none", 4, False, 1, "sdpa"), ("grad_op", "bf16", "full", 4),
        ("no_shard", "fp32", "full", 2), CHUNKED_PAIR[1:],
        CHUNKED_PAIR[1:] + (False, 1) + CHUNKED,
        ("full", "mixed", "full", 1, True, 2), ("no_shard", "mixed", "none", 4, False, 1) + CHUNKED,
        ("full", "fp32", "none", 2, False, 2), ("full", "fp32", "none", 4, False, 1, "varlen"),
        ("full", "fp32", "selective", 4),
        ("full", "mixed", "full", 1, False, 1) + CHUNKED,
        ("full", "bf16", "full", 1, False, 1, "", "adamw4bit"),
        ("full", "bf16", "full", 1, False, 1, "", "adamw4bit eager"),
        ("no_shard", "fp32", "none", 2, False, 1, "", "adamw8bit"),
        ("full", "bf16", "full", 1, False, 1, "", "", "qlora", "chunked offload"),
        ("no_shard", "fp32", "none", 4, False, 1, "", "", "lora"),
        ("full", "mixed", "full", 1, True, 2, "", "", "qlora", "chunked")],
    4: [("hybrid", "bf16", "none", 4, False, 1) + CHUNKED, ("grad_op", "fp32", "full", 1),
        ("full", "fp32", "full", 1), ("hybrid", "bf16", "full", 1, False, 1, "", "adamw4bit eager"),
        ("hybrid", "bf16", "full", 4, False, 1, "", "", "qlora"),
        ("full", "fp32", "full", 1, False, 1, "", "", "lora"), TIED_4_RANK_8BIT[1]],
}
REQUIRE_ENV = "LLAMA_FSDP_REQUIRE_MEMTRACK"  # CI (.ci/run): no C compiler fails, not skips


@pytest.fixture(scope="session")
def memtrack(tmp_path_factory):
    lib = B.build_memtrack(tmp_path_factory.mktemp("memtrack"))
    if lib is None:
        reason = "needs a C compiler (cc) on Linux to build the malloc shim"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but the planned-against-measured test cannot run: "
                        f"{reason}", pytrace=False)
        pytest.skip(reason)
    return lib


def band(world: int, case: tuple) -> tuple[float, float]:
    """The bounds of measured / predicted for a case (the module docstring's claims)."""
    if (world, case) == TIED_4_RANK_8BIT:
        return TIED_4_RANK_8BIT_BAND
    optim = case[7] if len(case) > 7 else ""  # B.overrides' optim and method, defaulted
    method = case[8] if len(case) > 8 else "full"
    return LOWBIT_OR_ADAPTERS_BAND if optim or method != "full" else ADAMW_BAND


def _specs(world: int) -> dict:
    return {B.case_name(world, *c): make_spec(B.overrides(world, *c),
                                              output_dir=f"/tmp/llama_fsdp_test/planmem_{world}")
            for c in CASES[world]}


@pytest.fixture(scope="module")
def measured(memtrack):
    """world -> (specs, each rank's results), measured once for the tests below."""
    cache: dict[int, tuple[dict, list]] = {}

    def get(world: int) -> tuple[dict, list]:
        if world not in cache:
            specs = _specs(world)
            with B.preloaded(memtrack):
                cache[world] = specs, run_ranks(B.measure_on_rank, world, specs, 2, timeout=900)
        return cache[world]
    return get


@pytest.mark.parametrize("world", sorted(CASES))
def test_measured_peak_is_within_tolerance_of_the_plan(world, measured):
    from llama_fsdp.plan import make_plan

    specs, results = measured(world)
    bands = {B.case_name(world, *c): band(world, c) for c in CASES[world]}
    report = []
    for name, spec in specs.items():
        plan = make_plan(spec)
        predicted, total = plan.predicted_peak_bytes, plan.memory.total
        state = plan.memory.params + plan.memory.optimizer
        if spec.mesh.ddp:  # no_shard: the grads stay in DDP's buckets between steps
            state += plan.memory.grads
        for rank, res in enumerate(results):
            r = res[name]
            measured, leftover = B.peak_of(r), r["end"]
            report.append(f"{name} rank {rank}: measured {measured / MB:.1f} MB, predicted "
                          f"{predicted / MB:.1f} ({measured / predicted:.3f}, peak in "
                          f"{plan.peak_phase}), sum {total / MB:.1f} ({measured / total:.3f}), "
                          f"left behind {leftover / MB:.2f}")
            assert abs(leftover) <= MAX_LEFTOVER, report[-1]
            # (with the state tensors too small for the shim: adapters, NF4 shards)
            start = r["steps"][-1]["start"] - leftover + r.get("small", 0)
            assert abs(start - state) <= MB + 0.01 * state, (
                f"{name} rank {rank}: {start / MB:.2f} MB live at the start of step 2, plan's "
                f"params + optimizer {state / MB:.2f} MB")
            lo, hi = bands[name]
            assert lo * predicted <= measured <= hi * predicted, (
                f"predicted peak off (band {lo}-{hi} for {name}):\n" + "\n".join(report))
            if spec.optim.eager:  # the sum has no term for the step (module docstring)
                continue
            assert measured <= total, "sum of components under-predicts:\n" + "\n".join(report)
            assert measured >= PLAN_LOOSEST * total, "sum too loose:\n" + "\n".join(report)
    print("\n".join(report))


def test_the_chunked_loss_lowers_the_measured_peak_as_planned(measured):
    """CHUNKED_PAIR with the full loss and with the chunked one: the measured peak drops by
    what the plan says (within 10%), the logits' and fp32 loss buffers' share of it."""
    from llama_fsdp.plan import make_plan

    specs, results = measured(CHUNKED_PAIR[0])
    names = [B.case_name(*CHUNKED_PAIR), B.case_name(*CHUNKED_PAIR, False, 1, *CHUNKED)]
    full, chunked = ([B.peak_of(r[name]) for r in results] for name in names)
    planned = (make_plan(specs[names[0]]).predicted_peak_bytes
               - make_plan(specs[names[1]]).predicted_peak_bytes)
    for rank, (f, c) in enumerate(zip(full, chunked)):
        print(f"rank {rank}: full {f / MB:.1f} MB, chunked {c / MB:.1f} MB, drop "
              f"{(f - c) / MB:.1f} MB, planned {planned / MB:.1f} MB")
        assert planned > 0.2 * f  # a drop worth measuring
        assert abs((f - c) / planned - 1) <= 0.10, (rank, f - c, planned)
