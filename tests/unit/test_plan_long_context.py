"""Long sequences in the plan: the chunked loss's and activation offload's terms, the longest
train.seq_len that fits, the fixes that name them, and the validator the fixes ask."""
from __future__ import annotations

import pytest

from llama_fsdp import plan as P
from llama_fsdp.plan import remedies as plan_fixes
from llama_fsdp.plan import variants
from llama_fsdp.plan.host import pinned_bytes
from llama_fsdp.run.spec import ConfigError
from tests import conftest

RTX4090 = ["cluster.device=cuda", "cluster.gpu_type=rtx4090", "dry_run=true",
           "train.batch_size=1", "checkpointing=full", "finetune=qlora"]
BIG_HOST = ["cluster=slurm", "cluster.timeout_min=60", "cluster.mem_gb=256"]


def make_spec(*overrides: str):
    return conftest.make_spec(list(overrides), output_dir="/tmp/llama_fsdp_test/plan_longctx")


def test_chunked_loss_replaces_the_logits_in_the_plan():
    """8B QLoRA at 8,192 tokens on a 24 GB card: the full loss peaks in the loss phase with
    12.6 GB of logits and fp32 loss buffers; the chunked loss holds one 1,024-token chunk."""
    full = P.make_plan(make_spec("model=8b", *RTX4090, "train.seq_len=8192", "train.loss=full"))
    chunked = P.make_plan(make_spec("model=8b", *RTX4090, "train.seq_len=8192"))
    assert full.peak_phase == "loss" and round(full.memory.logits_loss / 1e9, 2) == 12.61
    assert chunked.spec.train.loss == "chunked"  # the default
    vocab, hidden, tokens = 128256, 4096, 8192
    # one chunk: bf16 logits beside their fp32 copy, its hidden rows and fp32 vectors; the
    # hidden and its gradient over the micro-batch; no head gradient (frozen)
    one_chunk = 1024 * (vocab * 6 + hidden * 2 + 12) + 8 * tokens
    assert chunked.memory.logits_loss == one_chunk + 2 * 2 * tokens * hidden
    assert chunked.predicted_peak_bytes < full.predicted_peak_bytes - 10e9
    assert "loss, chunked (1024 tokens x vocab a chunk)" in chunked.table()


def test_every_plan_prints_the_longest_sequence_that_fits_and_it_is_the_boundary():
    for overrides in (("model=8b", *RTX4090, "train.seq_len=8192"),
                      ("model=8b", *RTX4090, "train.seq_len=8192", "train.loss=full"),
                      ("model=70b", *RTX4090, "cluster.nproc_per_node=4", "train.seq_len=2048"),
                      ("model=70b", *RTX4090, "cluster.nproc_per_node=4", "train.seq_len=2048",
                       "checkpointing.offload=true", *BIG_HOST)):
        plan = P.make_plan(make_spec(*overrides))
        longest = plan.longest_seq_len
        assert 0 < longest < plan.spec.model.max_position_embeddings, overrides
        assert P.make_plan(P.with_seq_len(plan.spec, longest)).fits, overrides
        assert not P.make_plan(P.with_seq_len(plan.spec, longest + P.fit.SEQ_STEP)).fits
        assert f"longest train.seq_len that fits at b=1: {longest:,}" in plan.table()
    tiny = P.make_plan(make_spec())  # the default command: capped by the model
    assert tiny.longest_seq_len == tiny.spec.model.max_position_embeddings
    assert "(model.max_position_embeddings)" in tiny.table()


def test_offload_keeps_two_inputs_on_the_device_and_every_one_pinned_on_the_host():
    base = ("model=8b", *RTX4090, "train.seq_len=32768")
    kept, off = (P.make_plan(make_spec(*base, *extra))
                 for extra in ((), ("checkpointing.offload=true",)))
    layer_input = 32768 * 4096 * 2  # b x s x hidden, bf16
    assert kept.memory.activations - off.memory.activations == (32 - 2) * layer_input
    assert off.memory.host_activations == 32 * pinned_bytes(layer_input) == 32 * layer_input
    assert pinned_bytes(3 * 2**20) == 4 * 2**20  # the caching host allocator's power of two
    assert "AC full, inputs offloaded" in off.table()
    assert "host RAM per rank (activation offload, pinned)" in off.table()
    # on CPU the inputs are host memory already: nothing moves
    cpu = ("cluster.device=cpu", "checkpointing=full")
    assert (P.make_plan(make_spec(*cpu)).phases
            == P.make_plan(make_spec(*cpu, "checkpointing.offload=true")).phases)


def test_offload_is_checked_against_the_host_and_says_when_recompute_dominates():
    base = ("model=8b", *RTX4090, "train.seq_len=65536", "checkpointing.offload=true",
            "cluster=slurm", "cluster.timeout_min=60", "cluster.gpus_per_node=1")
    small_host = P.make_plan(make_spec(*base, "cluster.mem_gb=16"))
    assert small_host.device_fits and not small_host.fits
    text = P.fixes_text(small_host.spec, small_host)
    assert "checkpointing.offload's layer inputs" in text
    assert "checkpointing.offload=false: " in text and "(does not fit the devices)" in text
    assert f"train.seq_len={small_host.longest_seq_len} (the longest" in text
    roomy = P.make_plan(make_spec(*base, "cluster.mem_gb=64"))
    assert roomy.fits and roomy.predicted_peak_gb <= 22.86
    assert "one layer's recompute in backward" in roomy.table()


def test_offload_needs_activation_checkpointing():
    with pytest.raises(ConfigError, match="checkpointing.offload=true with checkpointing=none"):
        make_spec("checkpointing=none", "checkpointing.offload=true")
    with pytest.raises(ConfigError, match="train.loss='fast' is not one of chunked, full"):
        make_spec("train.loss=fast")


def test_fixes_name_the_chunked_loss_offload_and_the_longest_sequence():
    spec = make_spec("model=8b", *RTX4090, "train.seq_len=65536", "train.loss=full")
    with pytest.raises(P.PlanError) as err:
        P.check_fits(spec)
    lines = [line for line in str(err.value).splitlines() if line.startswith("  - ")]
    text = "\n".join(lines)
    assert "  - train.loss=chunked (no b x s x vocab logits): " in text
    assert "  - checkpointing.offload=true: " in text
    longest = P.make_plan(spec).longest_seq_len
    assert f"  - train.seq_len={longest} (the longest that fits as configured)" in lines
    # chunked and offloaded together fit at 65,536 (on a host with the RAM for it)
    together = [line for line in lines if "train.loss=chunked checkpointing.offload=true" in line]
    assert together and together[0].endswith("(fits)"), text


def test_the_fixes_ask_the_validator(monkeypatch):
    """A validator that refuses every change leaves no config change to list: the planner
    restates none of its rules."""
    spec = make_spec("model=8b", *RTX4090, "train.seq_len=65536", "train.loss=full",
                     "checkpointing=selective", "precision=mixed")
    assert plan_fixes._variants(spec)
    monkeypatch.setattr(variants, "variant_problems", lambda s: ["refused"])
    assert plan_fixes._variants(spec) == []
    assert plan_fixes._method_fixes(spec) == []


@pytest.mark.parametrize("model,gpus,seq_len,extra,goal_gb", [
    ("8b", 1, 32768, (), 22.86),  # issue 40's goals, as the benchmark states them
    ("8b", 1, 65536, ("checkpointing.offload=true", *BIG_HOST, "cluster.gpus_per_node=1"),
     22.86),
    ("70b", 4, 16384, ("checkpointing.offload=true", *BIG_HOST, "cluster.gpus_per_node=4"),
     22.86),
])
def test_long_context_goals_on_24_gb_cards(model, gpus, seq_len, extra, goal_gb):
    plan = P.make_plan(make_spec(f"model={model}", *RTX4090, f"cluster.nproc_per_node={gpus}",
                                 f"train.seq_len={seq_len}", *extra))
    assert plan.fits and plan.predicted_peak_gb <= goal_gb, plan.table()
