"""The planner's model-state bytes equal what each real gloo rank holds after a training step."""
from __future__ import annotations

import pytest

from tests.conftest import make_spec
from tests.distributed import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

CASES = [("full", "fp32"), ("grad_op", "fp32"), ("no_shard", "fp32"), ("hybrid", "fp32"),
         ("full", "mixed"), ("full", "bf16")]


def _spec(world: int, strategy: str, precision: str):
    o = ["tracking.enabled=false", f"cluster.nproc_per_node={world}", "cluster.device=cpu",
         f"sharding={strategy}", f"precision={precision}", "train.batch_size=2",
         "train.seq_len=16"]
    if strategy == "hybrid" and world == 4:
        o.append("sharding.shard_size=2")
    return make_spec(o, output_dir=f"/tmp/llama_fsdp_test/plan_{strategy}_{precision}_{world}")


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _state_bytes(rank, world, specs):
    """(params, grads, optimizer) bytes this rank holds after one step, per case."""
    import torch

    from llama_fsdp.model.attention import model_inputs
    from llama_fsdp.train.optimizer import build_optimizer
    from llama_fsdp.objective.loss import loss_sum
    from llama_fsdp.train.worker import build_model

    out = {}
    for name, spec in specs.items():
        model = build_model(spec, torch.device("cpu"))
        opt = build_optimizer(model, spec.train, spec.optim)
        gen = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, spec.model.vocab_size, (2, 16), generator=gen)
        loss_sum(model, model_inputs(model, {"input_ids": ids, "labels": ids},
                                     torch.device("cpu"))).backward()
        opt.step()
        params = list(model.parameters())
        moments = [v for p in params for k, v in opt.state[p].items() if k != "step"]
        out[name] = (sum(_local_bytes(p) for p in params),
                     sum(_local_bytes(p.grad) for p in params),
                     sum(_local_bytes(m) for m in moments))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_holds_the_planned_model_state(world):
    from llama_fsdp.plan import make_plan

    specs = {f"{s}-{p}": _spec(world, s, p) for s, p in CASES}
    results = run_ranks(_state_bytes, world, specs)
    for name, spec in specs.items():
        mem = make_plan(spec).memory  # what the plan reports (its table, fits, check_fits)
        planned = (mem.params, mem.grads, mem.optimizer)
        for rank, got in enumerate(results):
            assert got[name] == planned, f"{name} rank {rank}: held {got[name]}, planned {planned}"
