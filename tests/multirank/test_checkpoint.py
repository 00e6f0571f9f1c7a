"""Weights in and out on real gloo ranks (fp32, CPU): HF load, exact and resharded resume, crash
safety, retention, export and conversion.

One module fixture runs four short trainings that every test reads, all starting from an HF
directory this module writes (model.path):

- ``a``: 2 ranks, 6 steps, a checkpoint every 2 steps written as one gathered file
  (save.full_state_dict), keep 2, HF export at the end. The uninterrupted reference.
- ``b``: the same run through the real launcher, killed (every rank ``os._exit``) in the middle
  of writing its step-4 checkpoint.
- ``b2``: ``output_dir=<b's run dir>`` and ``resume=auto``: continues b from step 2 with async
  sharded saves, in processes that trained nothing before; must reproduce a's losses 3..6
  exactly.
- ``c``: 4 ranks, hybrid 2x2, micro-batch 4 (same global batch), ``resume=<a>/step_000004``,
  ``train.stop_after=5``: one resharded step.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from llama_fsdp.checkpoint import dcp, layout
from llama_fsdp.config import rundir
from llama_fsdp.config.rundir import OPTIM_META
from tests.conftest import REPO, launch_prepared, make_spec
from tests.faults import hooks
from tests.distributed import run_ranks
from tests import warm

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 6
BASE = ["eval.every_steps=0", "train.warmup_steps=1", f"train.max_steps={STEPS}",
        "save.every_steps=2", "save.keep_last=2", "cluster.nproc_per_node=2"]
PROBE = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(7))
# Resharded resume: 4 ranks x micro-batch 4 see the same 16 rows per step as 2 ranks x 8, so
# the loss is the same number computed with other summation orders (reduce-scatter over 2 and
# all-reduce over 2 instead of one reduce-scatter over 2; GEMMs on 4-row instead of 8-row
# batches). fp32 rounding of that is ~1e-7 relative per op; we see ~1e-6 on the loss. A real
# resume fault (optimizer moments, LR step or data position off by one) moves it by >1e-2.
RESHARD_RTOL = 1e-4


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def _logits(model):
    """Logits of the probe batch, as numpy (passes between processes by value)."""
    from llama_fsdp.model.attention import model_inputs

    with torch.no_grad():
        inputs = model_inputs(model, {"input_ids": PROBE}, torch.device("cpu"))
        return model(**inputs).logits.float().numpy().copy()


def _close(x, y, **kw) -> None:
    torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(y), **kw)


def _train_and_probe(rank, world, spec_a, step6):
    """a (uninterrupted), then the sharded model's logits straight after an HF load and after
    loading a's final checkpoint."""
    from llama_fsdp.checkpoint import dcp, hf
    from llama_fsdp.train.worker import DistEnv, build_model, train_on_rank

    env, cpu = DistEnv(rank, rank, world, world), torch.device("cpu")
    out = {"a": train_on_rank(spec_a, env, cpu)}
    fresh = build_model(spec_a, cpu)
    hf.load_hf_weights(fresh, spec_a.model.path)
    out["hf_logits"] = _logits(fresh)
    trained = build_model(spec_a, cpu)
    dcp.load_model_weights(trained, Path(step6))
    out["a_logits"] = _logits(trained)
    return out


def _train(rank, world, spec):
    from llama_fsdp.train.worker import DistEnv, train_on_rank

    return train_on_rank(spec, DistEnv(rank, rank, world, world), torch.device("cpu"))


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny Llama saved by transformers in several safetensors files with an index, and its
    tokenizer (the project's sentencepiece one) beside it, as a hub snapshot has."""
    from transformers import LlamaForCausalLM

    from llama_fsdp.data import build_tokenizer
    from llama_fsdp.model.llama import llama_config

    spec = make_spec()
    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    LlamaForCausalLM(llama_config(spec.model)).save_pretrained(path, max_shard_size="2MB")
    build_tokenizer(spec.data, tmp_path_factory.mktemp("tok-cache")).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def runs(tmp_path_factory, hf_dir):
    from llama_fsdp.launchers import LaunchError
    from llama_fsdp.prepare.job import prepare

    root = tmp_path_factory.mktemp("ckpt")
    store = tmp_path_factory.mktemp("mlflow")  # beside, not inside, the runs' parent
    base = [*BASE, f"model.path={hf_dir}", f"tracking.uri=sqlite:///{store}/mlflow.db"]

    def spec(name, *extra):
        return make_spec([*base, *extra], output_dir=root / name)

    spec_a = spec("a", "save.full_state_dict=true", "save.export_hf=true")
    spec_b = spec("b", "train.callbacks=[tests.faults.hooks:kill_during_save]")
    spec_b2 = spec("b", "resume=auto", "save.async_save=true")
    os.environ[hooks.KILL_SAVE_STEP] = "4"
    try:
        with pytest.raises(LaunchError):
            launch_prepared(spec_b)
    finally:
        del os.environ[hooks.KILL_SAVE_STEP]
    for s in (spec_a, spec_b2):
        prepare(s, command="pytest")  # the MLflow runs, as the driver makes them
    ckpts_b = root / "b" / layout.CHECKPOINTS
    after_crash = {p.name: sorted(f.name for f in p.iterdir() if f.is_file())
                   for p in ckpts_b.iterdir()}
    step6 = layout.step_dir(root / "a", 6)
    two = run_ranks(_train_and_probe, 2, spec_a, str(step6))
    b2 = run_ranks(_train, 2, spec_b2)  # fresh processes: the checkpoint alone carries b
    a_before_c = _snapshot(root / "a")
    spec_c = spec("c", "cluster.nproc_per_node=4", "sharding=hybrid", "sharding.shard_size=2",
                  "train.batch_size=4", f"resume={layout.step_dir(root / 'a', 4)}",
                  "train.stop_after=5")
    prepare(spec_c, command="pytest")
    four = run_ranks(_train, 4, spec_c)
    return {"root": root, "hf": hf_dir, "a": two[0]["a"], "b2": b2[0], "c": four,
            "hf_logits": two[0]["hf_logits"], "a_logits": two[0]["a_logits"],
            "after_crash": after_crash, "a_snapshot": (a_before_c, _snapshot(root / "a")),
            "specs": {"a": spec_a, "b": spec_b, "c": spec_c}}


def test_sharded_load_from_hf_matches_transformers(runs):
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(runs["hf"]).eval()
    assert len(list(runs["hf"].glob("*.safetensors"))) > 1  # several files + index were read
    _close(runs["hf_logits"], _logits(ref), rtol=1e-5, atol=1e-5)


def test_exact_resume_after_a_crash_mid_save(runs):
    root = runs["root"]
    # the killed save left its .tmp without DCP metadata; step 2 stayed the newest checkpoint
    crash = runs["after_crash"]
    assert sorted(crash) == ["step_000002", "step_000004.tmp"]
    assert crash["step_000002"] == sorted([layout.METADATA, "__0_0.distcp", "__1_0.distcp",
                                           layout.MANIFEST, OPTIM_META, rundir.CHECKPOINT_RUN])
    # data, no metadata
    assert crash["step_000004.tmp"] == ["__0_0.distcp", "__1_0.distcp", OPTIM_META,
                                        rundir.CHECKPOINT_RUN]
    b2 = runs["b2"]
    assert b2.resumed_from == str(layout.step_dir(root / "b", 2))
    assert b2.steps == STEPS and len(b2.losses) == STEPS - 2
    # same world size, fp32, same data order: the continuation is the uninterrupted run
    assert b2.losses == runs["a"].losses[2:], (b2.losses, runs["a"].losses)
    assert b2.tokens_seen == runs["a"].tokens_seen
    # the async save of step 4 holds step 4's weights, not those of steps 5-6 trained while
    # it was written (the staging copy), equal to a's gathered step-4 checkpoint
    ours, theirs = (dcp.read_model_state(layout.step_dir(root / run, 4)) for run in ("b", "a"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # async saves published 4 and 6; retention dropped 2 and the interrupted 4.tmp
    assert [Path(p).name for p in b2.checkpoints] == ["step_000004", "step_000006"]
    assert sorted(p.name for p in (root / "b" / layout.CHECKPOINTS).iterdir()) == [
        "step_000004", "step_000006"]


def test_mlflow_run_continues_in_the_same_dir_and_records_the_source_elsewhere(runs):
    from mlflow.tracking import MlflowClient

    from llama_fsdp.tracking import read_run_file

    root = runs["root"]
    client = MlflowClient(tracking_uri=runs["specs"]["a"].tracking_uri)
    b_id = read_run_file(root / "b")["run_id"]
    assert runs["b2"].mlflow_run_id == b_id  # the crashed run's MLflow run goes on
    b_run = client.get_run(b_id)
    assert b_run.info.status == "FINISHED" and b_run.data.tags["resume_step"] == "2"
    assert "resumed_from" not in b_run.data.tags
    c_run = client.get_run(runs["c"][0].mlflow_run_id)
    assert c_run.info.run_id != runs["a"].mlflow_run_id
    assert c_run.data.tags["resumed_from"] == str(root / "a" / "checkpoints" / "step_000004")
    # each step once: b logged 1..4 before its crash; b2 resumed from step 2 (not from the
    # start), the SQLite store dropped b's 3 and 4 (tracking/mlflow_compat.py) and b2 logged
    # 3..6, equal to the uninterrupted a's
    history = sorted(client.get_metric_history(b_id, "loss"),
                     key=lambda m: (m.timestamp, m.step))
    assert [m.step for m in history] == [1, 2, 3, 4, 5, 6]
    assert [m.value for m in history[2:]] == runs["a"].losses[2:]


def test_resharded_resume_two_ranks_full_to_four_ranks_hybrid(runs):
    c, a = runs["c"][0], runs["a"]
    assert runs["specs"]["c"].mesh.shape == (2, 2) and runs["specs"]["c"].global_batch == 16
    assert c.steps == 5 and len(c.losses) == 1  # stop_after=5 on a 6-step schedule
    print(f"resharded resume: step 5 loss {c.losses[0]!r} vs {a.losses[4]!r} "
          f"(relative {abs(c.losses[0] / a.losses[4] - 1):.1e})")
    torch.testing.assert_close(c.losses[0], a.losses[4], rtol=RESHARD_RTOL, atol=0)
    assert c.checkpoints == [str(layout.step_dir(runs["root"] / "c", 5))]
    before, after = runs["a_snapshot"]
    assert before == after  # resuming from a's checkpoint changed nothing in a's run dir


def test_full_state_dict_checkpoints_and_retention(runs):
    a, root = runs["a"], runs["root"]
    assert a.steps == STEPS and a.resumed_from is None
    names = [Path(p).name for p in a.checkpoints]
    assert names == ["step_000004", "step_000006"]  # keep_last=2 of 2, 4, 6
    for p in a.checkpoints:
        data = sorted(f.name for f in Path(p).iterdir() if f.is_file())
        # gathered, one file
        assert data == sorted([".metadata", "__0_0.distcp", layout.MANIFEST, OPTIM_META,
                               rundir.CHECKPOINT_RUN])  # and the run that saved it
    assert sorted(p.name for p in root.iterdir()) == ["a", "b", "c"]  # nothing else written


def test_export_and_convert_load_in_transformers_with_the_trained_logits(runs, tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    export = Path(runs["a"].export_dir)
    assert export == runs["root"] / "a" / "export"
    names = sorted(p.name for p in export.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= set(names)
    exported = LlamaForCausalLM.from_pretrained(export).eval()
    _close(_logits(exported), runs["a_logits"], rtol=1e-5, atol=1e-5)
    # the converter, as a real CLI, on a's last (gathered) checkpoint: the same files
    out = tmp_path / "converted"
    step6 = runs["root"] / "a" / "checkpoints" / "step_000006"
    subprocess.run([warm.python(), "-m", "llama_fsdp.checkpoint.convert", str(step6), str(out)],
                   cwd=REPO, check=True, capture_output=True)
    assert sorted(p.name for p in out.iterdir()) == names
    for name in names:
        if name.endswith(".safetensors"):
            ours, theirs = load_file(out / name), load_file(export / name)
            assert ours.keys() == theirs.keys()
            assert all(torch.equal(ours[k], theirs[k]) for k in ours)
        else:
            assert (out / name).read_bytes() == (export / name).read_bytes(), name
    # and on b2's sharded, async-written step 6 (same training, so the same model)
    out_b = tmp_path / "converted_b"
    from llama_fsdp.checkpoint.convert import convert

    convert(runs["root"] / "b", out_b)
    resumed = LlamaForCausalLM.from_pretrained(out_b).eval()
    _close(_logits(resumed), runs["a_logits"], rtol=1e-5, atol=1e-5)


def _resume_crafted(rank, world, ckpt):
    """A rank resuming from a crafted checkpoint (the check before launch bypassed): the
    Checkpointer refuses it, and DCP's own load path (SafeReader) refuses it too."""
    from torch import nn

    from llama_fsdp.checkpoint.pickles import UnsafeCheckpoint
    from llama_fsdp.config.schema import SaveConfig
    from llama_fsdp.checkpoint.state import TrainState

    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    app = dcp.AppState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                       TrainState())
    ckpter = dcp.Checkpointer(SaveConfig(), output_dir=str(Path(ckpt).parent.parent), app=app,
                              device=torch.device("cpu"))
    out = []
    try:
        ckpter.resume([Path(ckpt)])
    except dcp.CheckpointError as e:
        out.append(str(e))
    try:
        ckpter.load(Path(ckpt))
    except UnsafeCheckpoint as e:
        out.append(str(e))
    return out


def test_a_rank_never_unpickles_a_crafted_checkpoint(tmp_path):
    """Before: Checkpointer.load read .metadata with torch's FileSystemReader (an unrestricted
    pickle.load), so the payload ran on every rank."""
    from tests.unit.test_checkpoint import crafted_checkpoint

    marker = tmp_path / "marker"
    ckpt = crafted_checkpoint(tmp_path / "run" / layout.CHECKPOINTS / "step_000004", marker)
    resumed, loaded = run_ranks(_resume_crafted, 1, str(ckpt))[0]
    assert "would load posix.system" in resumed and "would load posix.system" in loaded
    assert not marker.exists()
