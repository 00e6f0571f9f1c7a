"""FSDP2 on real gloo ranks: sharding is real, and N ranks train exactly like 1 rank."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import make_spec
from tests.distributed import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 6
BASE = ["tracking.enabled=false", "eval.every_steps=0", f"train.max_steps={STEPS}",
        "train.warmup_steps=2", "precision=fp32"]


def _spec(world: int, strategy: str, extra: list[str] = (), global_batch: int = 8):
    o = [*BASE, f"cluster.nproc_per_node={world}", f"sharding={strategy}",
         f"train.batch_size={global_batch // world}", *extra]
    if strategy.startswith("hybrid"):
        o.append("sharding.shard_size=2")
    return make_spec(o, output_dir=f"/tmp/llama_fsdp_test/{strategy}_{world}")


def _shard_fractions(rank, world, specs):
    """Local parameter fraction per strategy, and a fingerprint of each replica's shard."""
    import torch.distributed as dist

    from llama_fsdp.model.llama import build_meta_model, num_parameters
    from llama_fsdp.model.parallelize import local_numel
    from llama_fsdp.train.worker import build_model

    out = {}
    for name, spec in specs.items():
        model = build_model(spec, torch.device("cpu"))
        total = num_parameters(build_meta_model(spec.model))
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        fingerprint = float(sum(t.double().sum() for t in local))
        fps = [None] * world
        dist.all_gather_object(fps, fingerprint)
        out[name] = {"fraction": local_numel(model) / total, "fingerprints": fps}
    return out


def test_each_rank_holds_its_share_of_the_parameters():
    specs = {s: _spec(4, s) for s in ("full", "grad_op", "hybrid", "no_shard")}
    res = run_ranks(_shard_fractions, 4, specs)
    for rank_result in res:
        assert rank_result["full"]["fraction"] == pytest.approx(0.25, abs=0.01)
        assert rank_result["grad_op"]["fraction"] == pytest.approx(0.25, abs=0.01)
        assert rank_result["hybrid"]["fraction"] == pytest.approx(0.5, abs=0.01)
        assert rank_result["no_shard"]["fraction"] == pytest.approx(1.0)
    fp = res[0]["hybrid"]["fingerprints"]  # mesh (replicate=2, shard=2): ranks 0,2 and 1,3 replicas
    assert fp[0] == fp[2] and fp[1] == fp[3] and fp[0] != fp[1]
    fp = res[0]["no_shard"]["fingerprints"]
    assert len(set(fp)) == 1
    fp = res[0]["full"]["fingerprints"]
    assert len(set(fp)) == 4


def _curves(rank, world, specs):
    import torch.distributed as dist

    from llama_fsdp.train.worker import DistEnv, train_on_rank

    out = {}
    for name, spec in specs.items():
        r = train_on_rank(spec, DistEnv(rank, rank, world, world), torch.device("cpu"))
        gathered = [None] * world
        dist.all_gather_object(gathered, r.losses)
        out[name] = gathered
    return out


@pytest.fixture(scope="session")
def reference_curve():
    """One rank, with transformers' dense block-causal mask over the packed records (SDPA)."""
    sdpa = ["model.attn_implementation=sdpa"]
    return run_ranks(_curves, 1, {"full": _spec(1, "full", sdpa)})[0]["full"][0]


def test_two_ranks_match_one_rank(reference_curve):
    """N ranks give the 1-rank curve, with the CPU default attention over the packed records
    (varlen's block-sparse SDPA) against the dense mask: also with the held-out loss and the
    generated answers run through it every 3 steps, and every layer recomputed in backward
    from the same batch's records."""
    assert _spec(2, "full").model.attn_implementation == "varlen"  # auto, CPU, packed rows
    varlen = ["model.attn_implementation=varlen", "eval.every_steps=3", "eval.task_prompts=4",
              "checkpointing=full"]
    res = run_ranks(_curves, 2, {"full": _spec(2, "full"), "no_shard": _spec(2, "no_shard"),
                                 "grad_op": _spec(2, "grad_op"),
                                 "full-varlen": _spec(2, "full", varlen)})[0]
    for name, per_rank in res.items():
        assert per_rank[0] == per_rank[1], f"{name}: ranks disagree on the loss"
        torch.testing.assert_close(per_rank[0], reference_curve, rtol=2e-5, atol=2e-5,
                                   msg=f"{name} with 2 ranks diverged from 1 rank")


def test_four_ranks_match_one_rank_full_hybrid_no_shard(reference_curve):
    res = run_ranks(_curves, 4, {"full": _spec(4, "full"), "hybrid": _spec(4, "hybrid"),
                                 "no_shard": _spec(4, "no_shard")})[0]
    for name, per_rank in res.items():
        assert all(c == per_rank[0] for c in per_rank), f"{name}: ranks disagree on the loss"
        torch.testing.assert_close(per_rank[0], reference_curve, rtol=2e-5, atol=2e-5,
                                   msg=f"{name} with 4 ranks diverged from 1 rank")


def _grouping(rank, world, specs):
    """The FSDP units, and which vocabulary-sized weights are sharded (DTensor) right after
    the forward and when the embedding's backward is about to run."""
    from torch.distributed.tensor import DTensor

    from llama_fsdp.model.parallelize import fsdp_units
    from llama_fsdp.model.attention import model_inputs
    from llama_fsdp.objective.loss import loss_sum
    from llama_fsdp.train.worker import build_model

    out = {}
    for name, spec in specs.items():
        model = build_model(spec, torch.device("cpu"))
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        seen = {}

        def sharded():
            return {"embed": isinstance(embed.weight, DTensor),
                    "head": isinstance(head.weight, DTensor)}

        def on_embed_output(module, args, output):  # runs after FSDP's own forward hooks
            output.register_hook(lambda grad: seen.__setitem__("embedding backward", sharded()))

        hook = embed.register_forward_hook(on_embed_output)
        tokens = torch.randint(0, spec.model.vocab_size, (2, 17),
                               generator=torch.Generator().manual_seed(rank))
        batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
        loss = loss_sum(model, model_inputs(model, batch, torch.device("cpu")))
        seen["after forward"] = sharded()
        loss.backward()
        hook.remove()
        seen["after backward"] = sharded()
        out[name] = {"units": fsdp_units(model), "sharded": seen,
                     "embed grad": embed.weight.grad is not None}
    return out


def test_fsdp_units_are_torchtitans_grouping():
    """Untied: the embedding alone, each layer, [norm, lm_head] together, the root holding
    nothing. The embedding is resharded after forward and never all-gathered for its backward
    (it needs only the token ids); the head stays gathered from its forward to its backward.
    A tied embedding (one parameter at both ends) stays in the root. grad_op keeps every
    unit gathered until its backward."""
    tied = ["model.tie_word_embeddings=true"]
    res = run_ranks(_grouping, 2, {"full": _spec(2, "full"), "grad_op": _spec(2, "grad_op"),
                                   "tied": _spec(2, "full", tied)})[0]
    layers = [[f"model.layers.{i}"] for i in range(4)]
    assert res["full"]["units"] == [[""], ["model.embed_tokens"], *layers,
                                    ["model.norm", "lm_head"]]
    assert res["tied"]["units"] == [[""], *layers]
    assert res["full"]["sharded"] == {
        "after forward": {"embed": True, "head": False},
        "embedding backward": {"embed": True, "head": True},
        "after backward": {"embed": True, "head": True}}
    assert res["grad_op"]["sharded"]["after forward"] == {"embed": False, "head": False}
    assert res["grad_op"]["sharded"]["after backward"] == {"embed": True, "head": True}
    assert all(r["embed grad"] for r in res.values())


def _ddp_and_curves(rank, world, specs):
    from llama_fsdp.model.parallelize import uses_ddp
    from llama_fsdp.train.worker import build_model

    models = {name: build_model(spec, torch.device("cpu")) for name, spec in specs.items()}
    return {"ddp": {name: uses_ddp(m) for name, m in models.items()},
            "tensors": {name: len(list(m.parameters())) for name, m in models.items()},
            "curves": _curves(rank, world, specs)}


def test_no_shard_is_ddp_and_accumulates_like_fsdp():
    """no_shard replicates with DDP and all-reduces only in the last micro-batch's backward;
    with gradient accumulation and a tied embedding (which must stay one parameter) it still
    trains exactly as full sharding does."""
    accum = ["train.grad_accum=2", "model.tie_word_embeddings=true"]
    res = run_ranks(_ddp_and_curves, 2, {
        "full": _spec(2, "full", accum, global_batch=4),
        "no_shard": _spec(2, "no_shard", accum, global_batch=4)})[0]
    assert res["ddp"] == {"full": False, "no_shard": True}
    assert res["tensors"]["no_shard"] == res["tensors"]["full"], "the tie became two parameters"
    full, no_shard = res["curves"]["full"], res["curves"]["no_shard"]
    assert no_shard[0] == no_shard[1], "no_shard ranks disagree on the loss"
    assert no_shard[0][-1] < no_shard[0][0], "no_shard loss did not go down"
    torch.testing.assert_close(no_shard[0], full[0], rtol=2e-5, atol=2e-5)


def _clip_against_full_gradient(rank, world, specs):
    """clip_grad_norm on the local shards vs the norm of the gathered full gradient."""
    from llama_fsdp.model.parallelize import clip_grad_norm
    from llama_fsdp.model.attention import model_inputs
    from llama_fsdp.objective.loss import loss_sum
    from llama_fsdp.train.worker import build_model

    def full(g):
        return g.full_tensor() if hasattr(g, "full_tensor") else g.clone()

    out = {}
    for name, spec in specs.items():
        model = build_model(spec, torch.device("cpu"))
        tokens = torch.randint(0, spec.model.vocab_size, (2, 33),
                               generator=torch.Generator().manual_seed(rank))
        batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
        loss_sum(model, model_inputs(model, batch, torch.device("cpu"))).backward()
        params = list(model.parameters())
        before = [full(p.grad).double() for p in params]
        reference = float(torch.stack([g.pow(2).sum() for g in before]).sum().sqrt())
        max_norm = reference / 4
        total = clip_grad_norm(params, max_norm)
        after = [full(p.grad).double() for p in params]
        scale = max(max_norm / (reference + 1e-6), 0.0)
        err = max(float((a - b * scale).abs().max() / b.abs().max().clamp(min=1e-30))
                  for a, b in zip(after, before))
        out[name] = {"total": float(total), "reference": reference, "err": err}
    return out


def test_clip_grad_norm_is_the_full_gradient_norm_on_every_mesh():
    """The norm is summed over the sharded mesh dims only (hybrid: not over the replicas),
    and clipping scales every shard by the same factor."""
    res = run_ranks(_clip_against_full_gradient, 4,
                    {s: _spec(4, s) for s in ("full", "hybrid", "no_shard")})
    for rank, per in enumerate(res):
        for name, r in per.items():
            assert r["total"] == pytest.approx(r["reference"], rel=1e-5), (rank, name)
            assert r["total"] == pytest.approx(res[0][name]["total"], rel=1e-6), (rank, name)
            assert r["err"] < 1e-5, (rank, name, r["err"])
