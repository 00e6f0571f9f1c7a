"""LoRA and QLoRA on real gloo ranks with real torchao NF4 (fp32, CPU), from an HF base.

One module fixture trains every run the tests read (6 steps each, the same global batch of 8
rows), all from the HF directories this module writes (model.path): the tiny shape (GQA, k / v
128 rows) and, for QLoRA over 4 shards, the tiny shape with 8 k / v heads (``_mha``: k / v of
256 rows, whole NF4 groups over 4 shards):

- 2 ranks, full sharding: ``lora_2``, ``qlora_2`` (tracked in MLflow), each saving a DCP
  checkpoint every 3 steps; ``qlora_2s`` stops after its step-3 save;
- 2 ranks again, in fresh processes: ``qlora_2r`` continues ``qlora_2s`` (resume=auto), and
  ``qlora_bf16`` only loads the base (bf16, the frozen dtype of precision=bf16);
- 1 rank: ``lora_1``, ``qlora_1``, ``qlora_1r`` (resumes ``qlora_2`` on one rank) and
  ``qlora_1_mha``;
- 4 ranks: ``lora_4`` (full sharding), ``qlora_4`` (hybrid 2 x 2: the tiny shape's k / v
  projections cannot be NF4 over 4 shards, which the spec refuses, tested here too) and
  ``qlora_4_mha`` (full sharding, 4 shards).

Every rank reports what it computed itself: which of its frozen weights after build are not its
rows of the HF safetensors file, and its base after training; its gradient norm at each step;
its part of every adapter after training; its probe logits; the 16-bit staging buffers alive
at once while its base loaded. Every run exports its PEFT adapter; ``qlora_2`` also the merged
model.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from llama_fsdp.run.spec import ConfigError
from tests.conftest import make_spec
from tests.distributed import assert_rows_match, recorded_grad_norms, run_ranks, trained_parts

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 6
BASE = ["eval.every_steps=0", "train.warmup_steps=1", f"train.max_steps={STEPS}",
        "precision=fp32", "finetune.rank=8", "finetune.alpha=16",
        "train.lr=3e-3"]  # (folders of random weights: the from-scratch rate, not a pretrained one)
MHA = ["model.num_kv_heads=8"]  # k / v of 256 rows: 64 a shard over 4, whole NF4 groups
PROBE = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(7))
# 1 rank against 2 or 4: the same sums in another order (reduce-scatters, smaller GEMMs)
RTOL = 1e-4
# tiny's target projections: rows x columns (h 256, i 768; k / v 128 rows, 256 with MHA)
TARGET_ROWS = {"gqa": 2 * 256 + 2 * 128 + 3 * 768, "mha": 4 * 256 + 3 * 768}


def _logits(model):
    from llama_fsdp.model.attention import model_inputs

    with torch.no_grad():
        inputs = model_inputs(model, {"input_ids": PROBE}, torch.device("cpu"))
        return model(**inputs).logits.float().numpy().copy()


def _base(model) -> dict[str, list[torch.Tensor]]:
    """This rank's frozen weights (every inner tensor of an NF4 one), copied."""
    from llama_fsdp.model import nf4
    from llama_fsdp.model.lora import is_adapter

    out = {}
    for name, p in model.named_parameters():
        if not is_adapter(name):
            local = p.to_local() if hasattr(p, "to_local") else p
            out[name] = [t.clone() for t in (nf4.inner_tensors(local) if nf4.is_nf4(local)
                                             else [local.detach()])]
    return out


def _hf_weights(hf_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    full = {}
    for f in Path(hf_dir).glob("*.safetensors"):
        full.update(load_file(str(f)))
    return full


def _not_the_hf_rows(model, spec, rank: int) -> tuple[list[str], int]:
    """The frozen weights whose part on this rank is not its rows of the HF safetensors file,
    and how many weights are NF4. Rank r holds torch.chunk(weight, n)[r % n] of a shard group of
    n ranks (FSDP2 splits dim 0 as torch.chunk does; in hybrid, ranks r and r + n hold the same
    rows); an NF4 weight, those rows of to_nf4 of the whole HF weight (the per-shard
    quantization with the shared scaler mean is exact). Every HF weight must be there."""
    from llama_fsdp.model import nf4
    from llama_fsdp.model.lora import is_adapter

    hf, shards = _hf_weights(spec.model.path), spec.mesh.shard
    wrong, seen, quantized = [], set(), 0
    for name, p in model.named_parameters():
        if is_adapter(name):
            continue
        key = name.replace("._checkpoint_wrapped_module", "")
        seen.add(key)
        local = p.to_local() if hasattr(p, "to_local") else p
        whole = hf[key].to(p.dtype).contiguous()
        if nf4.is_nf4(local):
            quantized += 1
            whole = nf4.nf4_module().to_nf4(whole, local.block_size, local.scaler_block_size)
            mine = nf4.inner_tensors(torch.chunk(whole, shards)[rank % shards])
            same = all(torch.equal(a, b) for a, b in zip(nf4.inner_tensors(local), mine))
        else:
            same = torch.equal(local.detach(), torch.chunk(whole, shards)[rank % shards])
        if not same:
            wrong.append(key)
    return wrong + [f"{k} (not in the model)" for k in sorted(set(hf) - seen)], quantized


@contextlib.contextmanager
def _live_staging():
    """The most 16-bit staging bytes this rank held at once while its NF4 base loaded: every
    buffer checkpoint/peft.py stages rows in is watched (weakly, so holding it costs
    nothing), and at each DCP read into staging the buffers still alive are summed."""
    import weakref

    from llama_fsdp.checkpoint import peft as A

    watched, peak = [], [0]
    staging, load = A._staging, A.dcp.load

    def watch(p, device):
        t = staging(p, device)
        local = t.to_local() if hasattr(t, "to_local") else t
        watched.append((weakref.ref(local), local.numel() * local.element_size()))
        return t

    def read(state_dict, *args, **kw):
        peak[0] = max(peak[0], sum(n for ref, n in watched if ref() is not None))
        return load(state_dict, *args, **kw)

    A._staging, A.dcp.load = watch, read
    try:
        yield peak
    finally:
        A._staging, A.dcp.load = staging, load


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        all(torch.equal(x, y) for x, y in zip(a[k], b[k])) for k in a)


def _session(rank, world, specs, load_only=()):
    """Build, check, train and probe every run in turn (one process group per call); a run in
    ``load_only`` is only built (its base loaded), for its staging."""
    from llama_fsdp.train.worker import DistEnv, RankRun, build_model

    env, cpu = DistEnv(rank, rank, world, world), torch.device("cpu")
    out = {}
    for name, spec in specs.items():
        if name in load_only:
            with _live_staging() as staged:
                model = build_model(spec, cpu)
            not_hf, quantized = _not_the_hf_rows(model, spec, rank)
            out[name] = {"staging": staged[0], "not_hf_rows": not_hf, "nf4_weights": quantized}
            continue
        with _live_staging() as staged:
            run = RankRun.build(spec, env, cpu)
        before = _base(run.model)  # what build (and resume) left
        not_hf, quantized = _not_the_hf_rows(run.model, spec, rank)
        trained = {id(p) for p in run.model.parameters() if p.requires_grad}
        optimized = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
        with recorded_grad_norms() as norms:
            result = run.train()
        unchanged = _same(before, _base(run.model))  # before the probe (it leaves some gathered)
        parts = trained_parts(run.model)  # likewise
        out[name] = {
            "result": result, "parts": parts, "logits": _logits(run.model), "grad_norms": norms,
            "nf4_weights": quantized, "staging": staged[0], "not_hf_rows": not_hf,
            "base_unchanged": unchanged,
            "optimizer_holds_adapters_only": optimized == trained and all(
                "lora_" in n for n, p in run.model.named_parameters() if id(p) in trained)}
    return out


def _write_hf_dir(root: Path, *overrides: str) -> Path:
    from transformers import LlamaForCausalLM

    from llama_fsdp.data import build_tokenizer
    from llama_fsdp.model.llama import llama_config

    spec = make_spec(list(overrides))
    torch.manual_seed(3)
    path = root / "tiny-llama"
    LlamaForCausalLM(llama_config(spec.model)).save_pretrained(path)
    build_tokenizer(spec.data, root / "tok-cache").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return _write_hf_dir(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf_dir):
    from llama_fsdp.checkpoint import layout
    from llama_fsdp.prepare.job import prepare

    root = tmp_path_factory.mktemp("adapters")
    store = tmp_path_factory.mktemp("mlflow")
    hf_mha = _write_hf_dir(tmp_path_factory.mktemp("hf_mha"), *MHA)

    def spec(name, method, world, *extra, tracked=False, path=hf_dir):
        track = (f"tracking.uri=sqlite:///{store}/mlflow.db" if tracked
                 else "tracking.enabled=false")
        return make_spec([*BASE, f"model.path={path}", f"finetune={method}", track,
                          f"cluster.nproc_per_node={world}", f"train.batch_size={8 // world}",
                          *extra], output_dir=root / name)

    saving = "save.every_steps=3"
    two = {"lora_2": spec("lora_2", "lora", 2, saving),
           "qlora_2": spec("qlora_2", "qlora", 2, saving, "finetune.export_merged=true",
                           tracked=True),
           "qlora_2s": spec("qlora_2r", "qlora", 2, saving, "train.stop_after=3")}
    prepare(two["qlora_2"], command="pytest")  # its MLflow run, as the driver makes it
    out = run_ranks(_session, 2, two)
    # continued in the same directory (resume=auto) by processes that did not train it
    fresh = {"qlora_2r": spec("qlora_2r", "qlora", 2, saving, "resume=auto"),
             "qlora_bf16": spec("qlora_bf16", "qlora", 2, "precision=bf16")}
    for rank, r in enumerate(run_ranks(_session, 2, fresh, {"qlora_bf16"})):
        out[rank].update(r)
    step3 = layout.step_dir(root / "qlora_2", 3)
    one = {"lora_1": spec("lora_1", "lora", 1), "qlora_1": spec("qlora_1", "qlora", 1),
           "qlora_1r": spec("qlora_1r", "qlora", 1, f"resume={step3}"),
           "qlora_1_mha": spec("qlora_1_mha", "qlora", 1, *MHA, path=hf_mha)}
    out1 = run_ranks(_session, 1, one)
    four = {"lora_4": spec("lora_4", "lora", 4),
            "qlora_4": spec("qlora_4", "qlora", 4, "sharding=hybrid", "sharding.shard_size=2"),
            "qlora_4_mha": spec("qlora_4_mha", "qlora", 4, *MHA, path=hf_mha)}
    out4 = run_ranks(_session, 4, four)
    return {"rank0": {**out[0], **out1[0], **out4[0]}, "ranks": {"1": out1, "2": out, "4": out4},
            "hf": hf_dir, "specs": {**two, **fresh, **one, **four}, "root": root}


def _trained(runs):
    """("<world> ranks, rank <r>", run name, that rank's report) of every rank of every trained
    run."""
    for world, results in runs["ranks"].items():
        for rank, r in enumerate(results):
            for name, v in r.items():
                if "result" in v:
                    yield f"{world} ranks, rank {rank}", name, v


# per method: (a run on 2 or 4 ranks, the 1-rank run of its shape)
COMPARED = {"lora": [("lora_2", "lora_1"), ("lora_4", "lora_1")],
            "qlora": [("qlora_2", "qlora_1"), ("qlora_4", "qlora_1"),
                      ("qlora_4_mha", "qlora_1_mha")]}


# A trained adapter weight, 2 or 4 ranks against 1, after 6 AdamW steps: the same sums in
# another order, which the step's division by the gradient's root mean square magnifies where
# that is near zero (lora_A gets no gradient at the first step: B is zero). A shard stepped with a
# wrong gradient, or not stepped, is off by about lr a step.
ADAPTER_ATOL = 5e-4


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_loss_falls_and_each_rank_s_adapter_shard_is_the_one_rank_run_s_rows(runs, method):
    """What each rank computed alone: its own shard of every adapter after training (from its
    own reduce-scattered gradient, by its own AdamW step) equals the same rows of the 1-rank
    run's whole adapter; in hybrid each replica of a shard does. The ranks of a shard group
    hold different rows, together all of them."""
    for name, ref in COMPARED[method]:
        spec = runs["specs"][name]
        whole = runs["ranks"]["1"][0][ref]["parts"]
        per_rank = [r[name]["parts"] for r in runs["ranks"][str(spec.world_size)]]
        for rank, parts in enumerate(per_rank):
            assert_rows_match(parts, whole, rtol=RTOL, atol=ADAPTER_ATOL,
                              msg=f"{name}, rank {rank}")
        for key, (_, full) in whole.items():
            spans = sorted({(p[key][0], len(p[key][1])) for p in per_rank})
            assert len(spans) == spec.mesh.shard, (name, key, spans)
            assert [s for s, _ in spans] == [0] + [s + n for s, n in spans[:-1]], (name, key)
            assert sum(n for _, n in spans) == len(full), (name, key, spans)
    losses = runs["rank0"][f"{method}_1"]["result"].losses
    assert len(losses) == STEPS and losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_one_rank_equals_two_and_four(runs, method):
    """Losses and gradient norms per step: AdamW's update is blind to a gradient scaled by a
    constant (a loss not multiplied by the world size, say), the norm is not."""
    r = runs["rank0"]
    for name, ref in COMPARED[method]:
        for key in ("losses", "grad_norms"):
            got = (r[name]["result"].losses if key == "losses" else r[name]["grad_norms"])
            want = (r[ref]["result"].losses if key == "losses" else r[ref]["grad_norms"])
            assert len(got) == STEPS
            torch.testing.assert_close(got, want, rtol=RTOL, atol=0,
                                       msg=f"{name} vs {ref}: {key}")
    shards = {n: runs["specs"][n].mesh.shard for n, _ in COMPARED[method]}
    assert shards == ({"lora_2": 2, "lora_4": 4} if method == "lora"
                      else {"qlora_2": 2, "qlora_4": 2, "qlora_4_mha": 4})


def test_qlora_at_four_shards_of_the_tiny_shape_is_refused_with_the_fix(hf_dir):
    with pytest.raises(ConfigError) as e:
        make_spec(["finetune=qlora", "cluster.nproc_per_node=4"])
    msg = str(e.value)
    assert "k_proj, v_proj cannot be stored in NF4 over 4 shard(s)" in msg
    assert "a shard group of 1, 2 rank(s)" in msg and "finetune=lora" in msg


def test_the_frozen_base_is_the_hf_one_and_bit_identical_after_training(runs):
    """On every rank of every run (LoRA and QLoRA, on 1, 2 and 4 ranks, hybrid, resumed: a
    checkpoint holds no base): the base build left is this rank's rows of the HF safetensors
    file, and training left it unchanged."""
    seen = 0
    for where, name, r in _trained(runs):
        assert r["not_hf_rows"] == [], (where, name)
        assert r["base_unchanged"], (where, name)
        assert r["optimizer_holds_adapters_only"], (where, name)
        seen += 1
    assert seen == 2 * 4 + 4 + 4 * 3  # ranks x runs, for 2, 1 and 4 ranks


def test_nf4_shards_equal_the_whole_tensor_quantized(runs):
    """Every target projection of every QLoRA run is NF4 (and its rows those of the whole HF
    weight quantized, above), on every rank; the bf16 base too (loaded only)."""
    qlora = [(w, n, r) for w, n, r in _trained(runs) if n.startswith("qlora")]
    assert len(qlora) == 2 * 3 + 3 + 4 * 2
    qlora += [(f"2 ranks, rank {rank}", "qlora_bf16", r["qlora_bf16"])
              for rank, r in enumerate(runs["ranks"]["2"])]
    for where, name, r in qlora:
        spec = runs["specs"][name]
        want = len(spec.finetune.target_modules) * spec.model.num_layers
        assert r["nf4_weights"] == want and r["not_hf_rows"] == [], (where, name, r["not_hf_rows"])
    for where, name, r in _trained(runs):
        assert name.startswith("qlora") or r["nf4_weights"] == 0, (where, name)


def test_loading_stages_one_layers_rows_as_the_plan_says(runs):
    """No rank holds more than one decoder layer's target rows in 16 bits while loading the
    NF4 base: the staging buffers alive at once, measured on every rank, are one layer's rows
    of its shard in the frozen dtype (fp32 here; bf16 for precision=bf16), which is what
    plan/host.py's staging_bytes plans."""
    from llama_fsdp.plan.host import staging_bytes

    cases = {"qlora_2": ("gqa", 2, 4), "qlora_4": ("gqa", 2, 4), "qlora_4_mha": ("mha", 4, 4),
             "qlora_1": ("gqa", 1, 4), "qlora_bf16": ("gqa", 2, 2)}
    for name, (shape, shard, dtype_bytes) in cases.items():
        spec = runs["specs"][name]
        want = TARGET_ROWS[shape] * 256 // shard * dtype_bytes
        assert staging_bytes(spec) == want, name
        ranks = runs["ranks"][str(spec.world_size)]
        assert [r[name]["staging"] for r in ranks] == [want] * spec.world_size, name
    for where, name, r in _trained(runs):  # resumed runs load their base too
        assert r["staging"] == staging_bytes(runs["specs"][name]), (where, name)
        if name.startswith("lora"):
            assert r["staging"] == 0, (where, name)  # nothing staged: no NF4


def test_convert_says_where_an_adapter_checkpoint_s_model_is(runs):
    from llama_fsdp.checkpoint import layout
    from llama_fsdp.checkpoint.convert import convert

    with pytest.raises(ValueError, match="holds LoRA adapters only"):
        convert(layout.step_dir(runs["root"] / "qlora_2", 3), runs["root"] / "converted")


def test_resume_is_exact_and_works_on_another_world_size(runs):
    """Resumed by processes that did not train the run (the checkpoint alone carries it)."""
    r = runs["rank0"]
    full = r["qlora_2"]["result"].losses
    assert r["qlora_2s"]["result"].losses == full[:3]
    assert r["qlora_2r"]["result"].resumed_from.endswith("step_000003")
    assert r["qlora_2r"]["result"].losses == full[3:]  # same world size: bit-exact
    assert r["qlora_2r"]["grad_norms"] == r["qlora_2"]["grad_norms"][3:]
    torch.testing.assert_close(r["qlora_1r"]["result"].losses, full[3:], rtol=RTOL, atol=0)
    # the checkpoint holds the adapters, their AdamW moments and the loop's state: no base
    from llama_fsdp.checkpoint import dcp, layout

    model = dcp.read_model_state(layout.step_dir(runs["root"] / "qlora_2", 3))
    assert model and all(".lora_A." in k or ".lora_B." in k for k in model), sorted(model)[:3]


def _hf_model(path, **kw):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw).eval()


def _dequantized_base(hf_dir: Path, ft):
    """The HF base with every target weight replaced by to_nf4 of it, dequantized: the
    weights the QLoRA run trained over."""
    from llama_fsdp.model import nf4

    model = _hf_model(hf_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(f".{t}." in name for t in ft.target_modules):
                q = nf4.nf4_module().to_nf4(p.detach().contiguous(), ft.nf4_block_size,
                                            ft.nf4_scaler_block_size)
                p.copy_(q.get_original_weight())
    return model


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_peft_loads_the_exported_adapter_with_the_trained_logits(runs, method):
    from peft import PeftModel

    r = runs["rank0"][f"{method}_2"]
    export = Path(r["result"].export_dir)
    files = {f.name for f in export.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= files
    ft = runs["specs"][f"{method}_2"].finetune
    base = _hf_model(runs["hf"]) if method == "lora" else _dequantized_base(runs["hf"], ft)
    with torch.no_grad():
        plain = base(input_ids=PROBE).logits.numpy()
        got = PeftModel.from_pretrained(base, str(export))(input_ids=PROBE).logits.numpy()
    want = r["logits"]
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=1e-5,
                               atol=1e-5)
    assert abs(plain - want).max() > 1e-3  # the adapters changed the model


def test_qlora_merged_export_loads_with_the_trained_logits(runs):
    from llama_fsdp.config.rundir import RunDir

    merged = _hf_model(RunDir(runs["root"] / "qlora_2").export_merged)
    with torch.no_grad():
        got = merged(input_ids=PROBE).logits.numpy()
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(
        runs["rank0"]["qlora_2"]["logits"]), rtol=1e-4, atol=1e-4)


def test_the_adapter_is_the_logged_model_and_the_counts_are_columns(runs):
    from mlflow.tracking import MlflowClient

    from llama_fsdp.tracking.view import SELECTED

    spec, result = runs["specs"]["qlora_2"], runs["rank0"]["qlora_2"]["result"]
    client = MlflowClient(tracking_uri=spec.tracking_uri)
    run = client.get_run(result.mlflow_run_id)
    outputs = run.outputs.model_outputs
    assert len(outputs) == 1
    model = client.get_logged_model(outputs[0].model_id)
    assert model.model_type == "peft-lora" and model.params["finetune"] == "qlora"
    assert run.data.params["finetune.method"] == "qlora"
    trainable, total = run.data.metrics["trainable_params"], run.data.metrics["total_params"]
    # rank 8 on 7 projections of 4 layers (h=256, kv 128, i=768): 8 x (in + out) each
    assert trainable == 4 * 8 * (2 * 512 + 2 * 384 + 3 * 1024)
    assert total == trainable + 3_410_176
    # the base is the model's own weights: a LoRA model is no bigger than the full one
    assert run.data.metrics["base_params"] == 3_410_176
    assert run.data.metrics["trainable pct"] == 4.36  # 155,648 of 3,565,824 (4.36499...): 3 digits
    assert {"metrics.`trainable M`", "metrics.`trainable pct`", "metrics.`base M`"} <= \
        set(SELECTED)
