"""The log step's reduction read one step late (CUDA's default, forced here on gloo ranks):
the same losses at the same steps as the immediate read, and a stop request still agreed by
every rank and saved, one step later, after that step's own loss was read."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import make_spec
from tests.distributed import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 6
BASE = ["tracking.enabled=false", "eval.every_steps=0", f"train.max_steps={STEPS}",
        "train.warmup_steps=1", "precision=fp32", "cluster.nproc_per_node=2",
        "save.every_steps=100", "resume=none"]


def _runs(rank, world, cases):
    """Each case: (overrides, defer, stop_at); stop_at: rank 1 asks to stop from that step."""
    from llama_fsdp.train.stopping import USER
    from llama_fsdp.train.worker import DistEnv, RankRun

    out = {}
    for name, (overrides, defer, stop_at) in cases.items():
        spec = make_spec([*BASE, *overrides], output_dir=f"/tmp/llama_fsdp_test/log_reads/{name}")
        run = RankRun.build(spec, DistEnv(rank, rank, world, world), torch.device("cpu"))
        context = run.loop_context

        seen = []  # (step, how many losses were logged) as the step-end hooks see it

        def loop_context(stops, hang, run=run, context=context, defer=defer, stop_at=stop_at,
                         seen=seen):
            ctx = context(stops, hang)
            ask = (lambda: USER if rank == 1 and stop_at and run.state.step >= stop_at else 0)
            return dataclasses.replace(
                ctx, defer_log_reads=defer, stop_request=ask,
                on_step_end=[lambda st: seen.append((st.step, len(st.losses))), *ctx.on_step_end])

        run.loop_context = loop_context
        r = run.train()
        out[name] = {"status": r.status, "steps": r.steps, "losses": r.losses, "seen": seen,
                     "final": r.final, "checkpoints": [c.rsplit("/", 1)[-1] for c in r.checkpoints]}
    return out


@pytest.fixture(scope="module")
def runs():
    import shutil

    shutil.rmtree("/tmp/llama_fsdp_test/log_reads", ignore_errors=True)
    cases = {"now": ([], False, None), "late": ([], True, None),
             "now_every4": (["train.log_every=4"], False, None),
             "late_every4": (["train.log_every=4"], True, None),
             "now_stop": ([], False, 3), "late_stop": ([], True, 3),
             "late_saves": (["save.every_steps=2"], True, None)}
    return run_ranks(_runs, 2, cases)


def test_late_reads_log_the_same_losses_at_the_same_steps(runs):
    for rank in runs:
        assert len(rank["now"]["losses"]) == STEPS
        assert rank["late"]["losses"] == rank["now"]["losses"]
        # every 4th step and the last one
        assert len(rank["now_every4"]["losses"]) == 2
        assert rank["late_every4"]["losses"] == rank["now_every4"]["losses"]
        assert rank["late_every4"]["losses"] == [rank["now"]["losses"][3], rank["now"]["losses"][5]]
        for name in ("late", "late_every4"):
            final = rank[name]["final"]
            assert final["tokens_per_sec"] > 0 and final["step_time_s"] > 0
    assert runs[0]["late"]["losses"][-1] < runs[0]["late"]["losses"][0]  # it trains


def test_late_reads_wait_for_nothing_but_are_read_before_a_save(runs):
    for rank in runs:
        # the hooks of step s see the losses of steps before s: s's is read after s+1 is queued
        assert rank["late"]["seen"] == [(1, 0), (2, 1), (3, 2), (4, 3), (5, 4), (6, 6)]
        assert rank["now"]["seen"] == [(s, s) for s in range(1, STEPS + 1)]
        # a step that saves is read first: a non-finite loss never reaches a checkpoint
        assert rank["late_saves"]["seen"] == [(1, 0), (2, 2), (3, 2), (4, 4), (5, 4), (6, 6)]
        assert rank["late_saves"]["checkpoints"] == ["step_000004", "step_000006"]
        assert rank["late_saves"]["losses"] == rank["now"]["losses"]


def test_a_stop_request_is_agreed_and_saved_one_step_later(runs):
    for rank in runs:
        now, late = rank["now_stop"], rank["late_stop"]
        assert now["status"] == late["status"] == "stopped by the user"
        assert now["steps"] == 3 and now["checkpoints"] == ["step_000003"]
        assert late["steps"] == 4 and late["checkpoints"] == ["step_000004"]
        assert now["losses"] == rank["now"]["losses"][:3]
        # the step that is saved is read first (its loss logged and checked finite)
        assert late["losses"] == rank["now"]["losses"][:4]
