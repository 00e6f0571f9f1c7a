"""DPO (objective=dpo) on real gloo ranks, fp32 on the CPU, from an HF base (model.path).

One module fixture trains every run the tests read (4 steps, a global batch of 8 rows of
synthetic pairs, each row holding several pairs):

- 2 ranks: ``lora`` (micro-batch 4, tracked in MLflow, a checkpoint at step 2, its adapter
  exported), ``lora_2x2`` (micro-batch 2 x 2 accumulated), ``lora_1x4``, ``full`` (full
  fine-tuning: the frozen copy as reference), ``qlora``, ``full_ddp`` (sharding=no_shard),
  ``lora_zero2_ac`` (grad_op, full AC), ``lora_cached`` and ``full_cached``
  (objective.reference=cached, in a cache of their own, the first computing it),
  ``lora_cached_again`` (finds it), ``full_loss`` (``full`` with train.loss=full: every other
  run takes the default chunked head), ``lora_learns`` (the default command's shape for 20
  steps, the held-out pairs at the end);
- 2 ranks again, in fresh processes (the checkpoint alone carries a run): ``lora_r2`` (resumes
  ``lora``'s step-2 checkpoint) and ``full_cached_r2`` (resumes ``full``'s step 2 in a cache of
  its own: nothing cached yet);
- 1 rank: ``lora_1`` (micro-batch 8) and ``lora_r1`` (resumes ``lora``'s step 2).

Every rank reports what it computed itself: its gradient norm at each step, and for the runs in
PARTS its part of every trainable parameter after training.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from llama_fsdp.tracking import NullTracker
from tests.conftest import make_spec
from tests.distributed import (assert_rows_match, recorded_grad_norms, run_ranks,
                               trained_parts)

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 4
BASE = ["objective=dpo", "objective.beta=0.5", "eval.every_steps=0", "train.warmup_steps=1",
        f"train.max_steps={STEPS}", "precision=fp32", "data.num_records=240",
        "data.eval_records=24", "train.seq_len=64", "finetune.rank=8", "finetune.alpha=16",
        "train.lr=3e-3"]  # (folders of random weights: the from-scratch rate, not a pretrained one)
PROBE = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(7))
RTOL = 1e-4  # another world size or micro-batching: the same sums in another order
# A trained weight, likewise, to what AdamW's step makes of it: the step divides by the
# gradient's root mean square, so where that is near zero the same sums in another order move a
# weight further: up to 2e-6 here for full fine-tuning; up to 1.6e-4 for LoRA's A, which gets no
# gradient at the first step (B is zero) and a tiny one at the next. A shard stepped with a wrong
# gradient, or not stepped, is off by about lr (3e-3) a step.
FULL_ATOL, LORA_ATOL = 1e-5, 5e-4
# the runs whose ranks report their trained parts: LoRA on 2 ranks against 1, resumed and not;
# full fine-tuning's shards against a whole replica's (no_shard)
PARTS = ("lora", "lora_1", "lora_r2", "full", "full_ddp")


class Recorder(NullTracker):
    """Rank 0's metrics of an untracked run, kept in memory for the tests."""

    def __init__(self):
        self.metrics: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics, step):
        self.metrics.setdefault(step, {}).update(metrics)


def _logits(model):
    from llama_fsdp.model.attention import model_inputs

    with torch.no_grad():
        return model(**model_inputs(model, {"input_ids": PROBE}, torch.device("cpu"))
                     ).logits.numpy().copy()


def _local(model) -> dict[str, np.ndarray]:
    """This rank's shards, copied (numpy: they travel back to the test)."""
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().numpy().copy()
            for n, p in model.named_parameters()}


def _session(rank, world, specs):
    from llama_fsdp.train.worker import DistEnv, RankRun

    env, cpu = DistEnv(rank, rank, world, world), torch.device("cpu")
    out = {}
    for name, spec in specs.items():
        run = RankRun.build(spec, env, cpu)
        if isinstance(run.tracker, NullTracker):
            run.tracker = Recorder()
        ref = run.objective.reference
        ref_model = ref.model if ref is not None and ref.model is not run.model else None
        before = _local(ref_model) if ref_model is not None else None
        trained = {id(p) for p in run.model.parameters() if p.requires_grad}
        optimized = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
        with recorded_grad_norms() as norms:
            result = run.train()
        # (before the probe: its forward leaves the units FSDP2 keeps gathered unsharded)
        out[name] = {"parts": trained_parts(run.model) if name in PARTS else None,
                     "result": result, "logits": _logits(run.model), "grad_norms": norms,
                     "metrics": getattr(run.tracker, "metrics", None),
                     "optimizer_holds_what_trains": optimized == trained,
                     "cache_files": _cache_files(spec)}
        if ref_model is not None:
            out[name]["reference"] = _reference(ref_model, before, optimized)
    return out


def _cache_files(spec) -> dict[str, tuple[int, int]]:
    """Every file and folder of the reference log-prob cache after this run: its inode and
    mtime (ns). An entry written again (computed again) has new ones: the cache writes a
    fresh folder and renames it over the old."""
    from llama_fsdp.config.schema import ObjectiveConfig
    from llama_fsdp.objective.dpo_reference import REFERENCE_DIR

    if spec.objective.reference != ObjectiveConfig.CACHED:
        return {}
    root = Path(spec.cache_dir) / REFERENCE_DIR
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def _reference(ref_model, before, optimized) -> dict:
    """What this rank holds of a frozen reference copy after training, against ``before``."""
    after = _local(ref_model)
    return {"unchanged": all((before[k] == after[k]).all() for k in before),
            "frozen": not any(p.requires_grad or p.grad is not None
                              for p in ref_model.parameters()),
            "outside_the_optimizer": not ({id(p) for p in ref_model.parameters()} & optimized),
            "sharded_per_layer": _units(ref_model), "before": before}


def _units(model) -> list[list[str]]:
    from llama_fsdp.model.parallelize import fsdp_units

    return fsdp_units(model)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from transformers import LlamaForCausalLM

    from llama_fsdp.data import build_tokenizer
    from llama_fsdp.model.llama import llama_config

    spec = make_spec()
    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    LlamaForCausalLM(llama_config(spec.model)).save_pretrained(path)
    build_tokenizer(spec.data, tmp_path_factory.mktemp("tok-cache")).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf_dir):
    from llama_fsdp.checkpoint import layout
    from llama_fsdp.prepare.job import prepare

    root = tmp_path_factory.mktemp("dpo")
    store = tmp_path_factory.mktemp("mlflow")
    ref_cache = tmp_path_factory.mktemp("ref-cache")

    def spec(name, world, batch, *extra, tracked=False):
        track = (f"tracking.uri=sqlite:///{store}/mlflow.db" if tracked
                 else "tracking.enabled=false")
        return make_spec([*BASE, f"model.path={hf_dir}", track, f"cluster.nproc_per_node={world}",
                          f"train.batch_size={batch}", *extra], output_dir=root / name)

    cached = [f"cache_dir={ref_cache}", "objective.reference=cached"]
    two = {"lora": spec("lora", 2, 4, "finetune=lora", "save.every_steps=2",
                        "eval.every_steps=2", "eval.task_prompts=4", tracked=True),
           "lora_2x2": spec("lora_2x2", 2, 2, "finetune=lora", "train.grad_accum=2"),
           "lora_1x4": spec("lora_1x4", 2, 1, "finetune=lora", "train.grad_accum=4"),
           "full": spec("full", 2, 4, "finetune=full", "save.every_steps=2"),
           "full_loss": spec("full_loss", 2, 4, "finetune=full", "train.loss=full"),
           "qlora": spec("qlora", 2, 4, "finetune=qlora"),
           # the reference a whole replica (no_shard: DDP), and ZeRO-2 with every layer
           # checkpointed
           "full_ddp": spec("full_ddp", 2, 4, "finetune=full", "sharding=no_shard"),
           "lora_zero2_ac": spec("lora_zero2_ac", 2, 4, "finetune=lora", "sharding=grad_op",
                                 "checkpointing=full"),
           "lora_cached": spec("lora_cached", 2, 4, "finetune=lora", *cached),
           "lora_cached_again": spec("lora_cached_again", 2, 4, "finetune=lora", *cached),
           "full_cached": spec("full_cached", 2, 4, "finetune=full", *cached)}
    # the default command's data and rows (4000 pairs, 8 x 128 tokens per rank), 20 steps, the
    # held-out pairs at the end
    two["lora_learns"] = make_spec(
        ["objective=dpo", "finetune=lora", "tracking.enabled=false", "train.max_steps=20",
         "eval.every_steps=20", "eval.task_prompts=0", f"model.path={hf_dir}",
         "train.lr=3e-3", "finetune.rank=16", "finetune.alpha=32"],  # (as the default command)
        output_dir=root / "lora_learns")
    prepare(two["lora"], command="pytest")  # its MLflow run, as the driver makes it
    out = run_ranks(_session, 2, two)
    step2 = layout.step_dir(root / "lora", 2)
    resumed = {"lora_r2": spec("lora_r2", 2, 4, "finetune=lora", f"resume={step2}"),
               # resumes full's step 2 with no cache yet: the reference's log-probs must come
               # from the initial weights (a copy made for them), not from the policy
               "full_cached_r2": spec("full_cached_r2", 2, 4, "finetune=full",
                                      "objective.reference=cached",
                                      f"cache_dir={tmp_path_factory.mktemp('ref-cache-2')}",
                                      f"resume={layout.step_dir(root / 'full', 2)}")}
    for rank, r in enumerate(run_ranks(_session, 2, resumed)):  # fresh processes
        out[rank].update(r)
    one = {"lora_1": spec("lora_1", 1, 8, "finetune=lora"),
           "lora_r1": spec("lora_r1", 1, 8, "finetune=lora", f"resume={step2}")}
    out0 = {**out[0], **run_ranks(_session, 1, one)[0]}
    return {"rank0": out0, "ranks": out, "hf": hf_dir, "specs": {**two, **resumed, **one},
            "root": root, "ref_cache": ref_cache}


def _losses(runs, name):
    return runs["rank0"][name]["result"].losses


def test_the_first_step_loses_exactly_ln2_with_zero_rewards(runs):
    """Policy and reference are the same weights at the first step (B = 0, or the copy)."""
    for name in ("lora", "lora_2x2", "full", "qlora", "full_ddp", "lora_1"):
        # (a mean of fp32 ln 2 over the pairs: ln 2 to fp32's rounding)
        assert _losses(runs, name)[0] == pytest.approx(math.log(2), rel=1e-6, abs=0), name
    for name in ("lora_2x2", "full"):
        first = runs["rank0"][name]["metrics"][1]
        assert first["rewards/chosen"] == first["rewards/rejected"] == 0.0, name
        assert first["rewards/margin"] == 0.0 and first["rewards/accuracy"] == 0.0, name
    later = runs["rank0"]["full"]["metrics"][STEPS]
    assert later["rewards/margin"] != 0.0 and later["logps/chosen"] < 0


def test_held_out_reward_accuracy_rises_well_above_chance(runs):
    """The synthetic pairs' chosen answer is the right one: after 20 steps of the default
    command's shape most held-out pairs prefer it (0 at step 0: every margin is 0)."""
    final = runs["rank0"]["lora_learns"]["result"].final
    assert final["eval_rewards/accuracy"] >= 0.7, final
    assert final["eval_rewards/margin"] > 0 and final["eval_loss"] < 0.6


def _grad_norms(runs, name):
    return runs["rank0"][name]["grad_norms"]


def test_micro_batches_and_world_sizes_agree(runs):
    """micro-batch 4 == 2 x 2 accumulated == 1 x 4; 1 rank == 2 ranks; FSDP == DDP: the losses
    and the gradient norms per step (AdamW's update is blind to a gradient scaled by a
    constant, the norm is not)."""
    want = _losses(runs, "lora")
    assert len(want) == STEPS and want[-1] < want[0]
    pairs = [(name, "lora") for name in ("lora_2x2", "lora_1x4", "lora_1", "lora_zero2_ac")]
    for name, ref in [*pairs, ("full_ddp", "full")]:
        for numbers in (_losses, _grad_norms):
            got, expected = numbers(runs, name), numbers(runs, ref)
            assert len(got) == STEPS, (name, numbers.__name__)
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=0,
                                       msg=f"{name} vs {ref}: {numbers.__name__}")
    assert _losses(runs, "qlora")[-1] < _losses(runs, "qlora")[0]
    m2, m1 = runs["rank0"]["lora_2x2"]["metrics"], runs["rank0"]["lora_1"]["metrics"]
    for key in ("rewards/margin", "logps/chosen", "logps/rejected"):
        assert m2[STEPS][key] == pytest.approx(m1[STEPS][key], rel=RTOL, abs=1e-6), key


def test_each_rank_s_shards_are_the_same_rows_of_a_whole_run(runs):
    """What each rank computes alone, after 4 steps: its LoRA shards (its own reduce-scattered
    gradient, its own AdamW step) are the same rows of the 1-rank run's adapters, and full
    fine-tuning's shards the same rows of the weights each replica of no_shard computed."""
    whole = runs["rank0"]["lora_1"]["parts"]
    for rank, r in enumerate(runs["ranks"]):
        assert_rows_match(r["lora"]["parts"], whole, rtol=RTOL, atol=LORA_ATOL,
                          msg=f"lora, rank {rank}")
        assert_rows_match(r["full"]["parts"], r["full_ddp"]["parts"], rtol=RTOL,
                          atol=FULL_ATOL, msg=f"full, rank {rank}")
    for run in ("lora", "full"):  # each rank its half of every tensor, not all of one
        halves = [r[run]["parts"] for r in runs["ranks"]]
        assert all(halves[1][n][0] == len(rows) for n, (_, rows) in halves[0].items()), run


def test_the_chunked_head_trains_as_the_full_logits_do(runs):
    """DPO's log-probs through train.loss=chunked's head (``full``: the policy's, with a
    trainable head, and the frozen copy's) give the losses and log-probs of train.loss=full,
    step after step."""
    specs = runs["specs"]
    assert (specs["full"].train.loss, specs["full_loss"].train.loss) == ("chunked", "full")
    want = _losses(runs, "full_loss")
    assert len(want) == STEPS and want[-1] < want[0]
    torch.testing.assert_close(_losses(runs, "full"), want, rtol=RTOL, atol=0)
    chunked, full = runs["rank0"]["full"]["metrics"], runs["rank0"]["full_loss"]["metrics"]
    for key in ("rewards/margin", "logps/chosen", "logps/rejected"):
        assert chunked[STEPS][key] == pytest.approx(full[STEPS][key], rel=RTOL, abs=1e-6), key


def test_resume_is_exact_and_works_on_another_world_size(runs):
    """Resumed by processes that did not train the run (the checkpoint alone carries it): on
    the same world size every step's loss and gradient norm, and each rank's trained shards,
    are bit-exact."""
    full = _losses(runs, "lora")
    assert runs["rank0"]["lora_r2"]["result"].resumed_from.endswith("step_000002")
    assert _losses(runs, "lora_r2") == full[2:]
    assert _grad_norms(runs, "lora_r2") == _grad_norms(runs, "lora")[2:]
    for rank, r in enumerate(runs["ranks"]):
        resumed, straight = r["lora_r2"]["parts"], r["lora"]["parts"]
        assert resumed and resumed.keys() == straight.keys(), rank
        for n, (start, rows) in resumed.items():
            assert start == straight[n][0] and np.array_equal(rows, straight[n][1]), (rank, n)
    torch.testing.assert_close(_losses(runs, "lora_r1"), full[2:], rtol=RTOL, atol=0)


def test_full_fine_tuning_keeps_its_reference_frozen_sharded_and_bit_identical(runs):
    from safetensors.torch import load_file

    hf = {}
    for f in Path(runs["hf"]).glob("*.safetensors"):
        hf.update(load_file(str(f)))
    world = len(runs["ranks"])
    for rank, r in enumerate(runs["ranks"]):
        ref = r["full"]["reference"]
        assert ref["unchanged"] and ref["frozen"] and ref["outside_the_optimizer"], rank
        assert r["full"]["optimizer_holds_what_trains"], rank
        units = ref["sharded_per_layer"]  # the embedding, each layer, [norm, head], the root
        assert len(units) == 4 + 3 and ["model.norm", "lm_head"] in units, rank
        # its shards are this rank's rows of the HF weights it started from (FSDP2 splits
        # dim 0 as torch.chunk does, rank r holding chunk r)
        shards = {n.replace("._checkpoint_wrapped_module", ""): v
                  for n, v in ref["before"].items()}
        assert shards.keys() == hf.keys(), rank
        for name, shard in shards.items():
            own = torch.chunk(hf[name], world)[rank]
            assert torch.equal(torch.from_numpy(shard), own), (rank, name)
    # the checkpoint holds the policy only: as many model tensors as HF has
    from llama_fsdp.checkpoint import dcp, layout

    saved = dcp.read_model_state(layout.step_dir(runs["root"] / "full", STEPS))
    assert len(saved) == len(hf) and not any("reference" in k for k in saved)


def test_cached_reference_log_probs_are_computed_once_and_train_alike(runs):
    root = Path(runs["ref_cache"]) / "reference"
    entries = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    # lora and full start from the same HF weights: one entry serves both
    assert len(entries) == 1, entries
    # computed once: lora_cached wrote the entry; the runs after it (in order, on every rank)
    # read it and wrote nothing: each file the same inode and mtime as lora_cached left it
    for rank, r in enumerate(runs["ranks"]):
        first = r["lora_cached"]["cache_files"]
        assert f"{entries[0].name}/train.npy" in first, (rank, sorted(first))
        for again in ("lora_cached_again", "full_cached"):
            assert r[again]["cache_files"] == first, (rank, again, r[again]["cache_files"], first)
    train = np.load(entries[0] / "train.npy")
    assert train.dtype.name == "float32" and (train < 0).all() and len(train) == 2 * 240
    for cached, live in (("lora_cached", "lora"), ("lora_cached_again", "lora"),
                         ("full_cached", "full")):
        torch.testing.assert_close(_losses(runs, cached), _losses(runs, live), rtol=1e-5,
                                   atol=0, msg=cached)
    assert _losses(runs, "lora_cached_again") == _losses(runs, "lora_cached")
    assert "reference" not in runs["rank0"]["full_cached"]  # no model beside the policy
    torch.testing.assert_close(_losses(runs, "full_cached_r2"), _losses(runs, "full")[2:],
                               rtol=1e-5, atol=0)


def test_peft_loads_the_exported_adapter_with_the_trained_logits(runs):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    r = runs["rank0"]["lora"]
    base = LlamaForCausalLM.from_pretrained(str(runs["hf"]), dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(input_ids=PROBE).logits.numpy()
        got = PeftModel.from_pretrained(base, r["result"].export_dir)(input_ids=PROBE).logits
    torch.testing.assert_close(got, torch.from_numpy(r["logits"]), rtol=1e-5, atol=1e-5)
    assert abs(plain - r["logits"]).max() > 1e-4  # DPO moved the model


def test_mlflow_has_the_dpo_metrics_per_step_and_at_eval_and_the_adapter(runs):
    from mlflow.tracking import MlflowClient

    spec, result = runs["specs"]["lora"], runs["rank0"]["lora"]["result"]
    client = MlflowClient(tracking_uri=spec.tracking_uri)
    run = client.get_run(result.mlflow_run_id)
    # DPO's loss under names of its own (a chart apart from SFT's cross-entropy)
    assert not {"loss", "eval_loss", "summary/final_loss", "summary/eval_loss"} & set(
        run.data.metrics)
    for key in ("dpo_loss", "rewards/chosen", "rewards/rejected", "rewards/margin",
                "rewards/accuracy", "logps/chosen", "logps/rejected"):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert steps == list(range(1, STEPS + 1)), key
    for key in ("eval_dpo_loss", "eval_rewards/accuracy", "eval_rewards/margin",
                "eval_logps/chosen", "eval_exact_match"):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert steps == [0, 2, 4], key
    assert run.data.metrics["summary/final_dpo_loss"] == result.final["loss"]
    assert run.data.metrics["summary/eval_dpo_loss"] == result.final["eval_loss"]
    baseline = client.get_metric_history(run.info.run_id, "eval_dpo_loss")[0].value
    assert baseline == pytest.approx(math.log(2), rel=1e-6)
    # the summary is each number's last logged value (accuracy and margin: not one for another)
    for key, source in (("summary/reward_accuracy", "rewards/accuracy"),
                        ("summary/reward_margin", "rewards/margin"),
                        ("summary/eval_reward_accuracy", "eval_rewards/accuracy"),
                        ("summary/eval_reward_margin", "eval_rewards/margin")):
        last = max(client.get_metric_history(run.info.run_id, source), key=lambda m: m.step)
        assert run.data.metrics[key] == last.value, (key, source)
    assert run.data.params["objective.name"] == "dpo" and run.data.params["objective.beta"] == "0.5"
    model = client.get_logged_model(run.outputs.model_outputs[0].model_id)
    assert model.model_type == "peft-lora"


# --- the gradients of one step, sharded against one process ----------------------------------

VIEW_WARNING = "returned a view tensor"


class _GradTap:
    """Stands in for the optimizer in train_step: keeps every trained parameter's whole gradient
    (a sharded one gathered) when the step is taken, and changes nothing."""

    def __init__(self, model):
        self.model, self.grads, self.param_groups = model, {}, []

    def step(self):
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                self.grads[name.replace("module.", "")] = g.detach().numpy().copy()

    def zero_grad(self, set_to_none=True):
        pass


def _first_step_grads(rank, world, specs):
    """Each spec's first DPO step through train_step on this rank's micro-batch: the whole
    gradients and the FSDP2 view warnings its forward and backward raised."""
    import warnings

    from llama_fsdp.train.loop import train_step
    from llama_fsdp.train.worker import DistEnv, RankRun

    env, cpu, out = DistEnv(rank, rank, world, world), torch.device("cpu"), {}
    for name, spec in specs.items():
        run = RankRun.build(spec, env, cpu)
        batch = next(iter(run.objective.batches(run.data.train_batches())))
        tap = _GradTap(run.model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = train_step(run.model, tap, run.scheduler, [batch], device=cpu,
                              max_grad_norm=0.0, loss_fn=run.objective.loss)
        out[name] = {"grads": tap.grads, "loss": float(step.loss),
                     "views": [str(w.message) for w in caught if VIEW_WARNING in str(w.message)]}
    return out


@pytest.mark.parametrize("method", ["lora", "full"])
def test_dpo_gradients_on_two_ranks_equal_one_process_and_fsdp2_warns_of_no_view(
        hf_dir, tmp_path, method):
    """One DPO step's gradients, FSDP2 on 2 gloo ranks (the chunked head, the reference the
    policy with its adapters off, or a frozen sharded copy) against one process with no FSDP
    (sharding=no_shard on 1 rank: plain autograd); and FSDP2's warning that a wrapped module
    returned a view (which an in-place op would detach from its pre-backward hook) never
    raised: the head used to return its log-probs as a view of a flat tensor."""
    def spec(world, batch, *extra):
        return make_spec([*BASE, f"model.path={hf_dir}", "tracking.enabled=false",
                          f"cluster.nproc_per_node={world}", f"train.batch_size={batch}",
                          f"finetune={method}", *extra], output_dir=tmp_path / f"w{world}")

    sharded = run_ranks(_first_step_grads, 2, {"run": spec(2, 4)})
    one = run_ranks(_first_step_grads, 1, {"run": spec(1, 8, "sharding=no_shard")})[0]["run"]
    for rank, got in enumerate(sharded):
        assert got["run"]["views"] == [], (rank, got["run"]["views"][:1])
    got = sharded[0]["run"]
    # (each rank's loss: its pairs' share of the global mean)
    assert sum(r["run"]["loss"] for r in sharded) == pytest.approx(math.log(2), rel=1e-6)
    assert one["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert sorted(got["grads"]) == sorted(one["grads"]) and got["grads"]
    for name, want in one["grads"].items():
        # every trained weight gets a gradient, but A's is B^T (...) with B = 0 at the start
        assert np.abs(want).max() > 0 or name.endswith("lora_A.weight"), name
        np.testing.assert_allclose(got["grads"][name], want, rtol=1e-4, atol=1e-7,
                                   err_msg=name)
