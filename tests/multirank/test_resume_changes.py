"""Resuming a diverged run, on 2 real gloo ranks (the tiny recipe, a checkpoint every step,
written in the background: save.async_save), as the guard's report tells a user to:

- ``first``: train.lr=3.0 runs away (6.4 -> ~254 -> ~1800) and stops at step 3. Step 2 was above
  the guard's line (not saved); the save of step 1 was still in flight: it is published before
  the run stops, and the report names it (it was left as step_000001.tmp).
- ``lower``: the same folder with train.lr=3e-4, one more step (stop_after=2): it runs at 3e-4
  on the schedule (it ran at the checkpoint's 2.9) and rank 0 says the change in one line. Its
  loss is step 2's again (~254: the loss of the weights step 1 left): the guard's history came
  back with the checkpoint, so the step is above the line and not saved, not even as the final
  checkpoint (a fresh history saved it, and called it the last good checkpoint).
"""
from __future__ import annotations

import logging

import pytest

from llama_fsdp.config import metrics as m
from tests.conftest import make_spec
from tests.distributed import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

BASE = ["train.max_steps=8", "save.every_steps=1", "save.async_save=true", "save.keep_last=3",
        "tracking.enabled=false", "eval.every_steps=0", "eval.task_prompts=0",
        "save.export_hf=false"]


def _runs(rank, world, specs):
    """Each spec in turn in these processes: its result, the checkpoints after it, and what rank
    0 logged about the resume."""
    import torch

    from llama_fsdp.checkpoint import list_checkpoints
    from llama_fsdp.train.worker import DistEnv, RankRun

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("llama_fsdp.train.resume").addHandler(Keep())
    logging.getLogger("llama_fsdp.train.resume").setLevel(logging.INFO)
    env, out = DistEnv(rank, rank, world, world), {}
    for name, spec in specs.items():
        del lines[:]
        result = RankRun.build(spec, env, torch.device("cpu")).train()
        out[name] = {"result": result, "lines": list(lines),
                     "saved": [p.name for _, p in list_checkpoints(spec.output_dir)]}
    return out


def test_a_resume_takes_the_configs_lr_and_the_guards_history(tmp_path):
    run = tmp_path / "run"
    specs = {"first": make_spec([*BASE, "train.lr=3.0"], output_dir=run),
             "lower": make_spec([*BASE, "train.lr=3e-4", "train.stop_after=2"], output_dir=run)}
    out = run_ranks(_runs, 2, specs, timeout=600)[0]
    first, lower = out["first"], out["lower"]

    r = first["result"]
    assert r.status == "diverged" and r.steps == 3, (r.status, r.steps, r.losses)
    assert r.losses[1] > 10 * r.losses[0]  # step 2 ran away already
    assert first["saved"] == ["step_000001"], first["saved"]  # published, not stranded
    assert not list((run / "checkpoints").glob("*.tmp"))
    assert "last good checkpoint: step_000001 (resume=auto continues from it)" in r.report

    r = lower["result"]
    assert r.resumed_from.endswith("step_000001") and r.status == "finished", r.status
    # step 2 runs at 3e-4 x the cosine from step 0 (warm-up 0: a tenth of 8 steps) to step 8
    from llama_fsdp.train.loop import lr_factor

    t = specs["lower"].train
    want = 3e-4 * lr_factor(1, warmup=t.warmup_steps, max_steps=8, min_ratio=t.min_lr_ratio)
    assert r.final[m.LR] == pytest.approx(want, rel=1e-6), r.final[m.LR]
    assert lower["lines"] == ["resume: train.lr 3.0 -> 3.0e-04 (the config's value applies)"]
    assert r.losses == pytest.approx([first["result"].losses[1]], rel=1e-4)  # step 2's again
    assert lower["saved"] == ["step_000001"], lower["saved"]  # above the line: not saved


def _old_then_new(rank, world, root):
    """A checkpoint written without the guard's history and the hyperparameters (before issue
    63), loaded by an AppState that has both."""
    import torch
    from torch import nn

    from llama_fsdp.checkpoint import dcp
    from llama_fsdp.checkpoint.state import TrainState
    from llama_fsdp.config.schema import DivergenceConfig, SaveConfig
    from llama_fsdp.train.divergence import DivergenceGuard

    def app(**kw):
        model = nn.Linear(2, 2)
        opt = torch.optim.AdamW(model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        return dcp.AppState(model, opt, sched, TrainState(step=5), **kw)

    old = dcp.Checkpointer(SaveConfig(every_steps=1), output_dir=root, app=app(),
                           device=torch.device("cpu"))
    path = old.save(5)
    guard = DivergenceGuard(DivergenceConfig())
    new = app(guard=guard, hparams={"train.lr": 1e-3})
    new.train_state.step = 0
    ckpter = dcp.Checkpointer(SaveConfig(), output_dir=root, app=new, device=torch.device("cpu"))
    resumed = ckpter.resume([path])
    return str(resumed), new.train_state.step, new.saved_hparams, guard.state_dict()


def test_a_checkpoint_from_before_still_resumes(tmp_path):
    resumed, step, saved, guard = run_ranks(_old_then_new, 1, str(tmp_path / "run"))[0]
    assert resumed.endswith("step_000005") and step == 5
    assert saved is None and guard["recent"] == []  # nothing to restore: a fresh history
