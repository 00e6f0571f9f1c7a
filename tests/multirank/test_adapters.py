"""LoRA and QLoRA on real gloo ranks with real torchao NF4 (fp32, CPU), from an HF base.

One module fixture trains every run the tests read (6 steps each, the same global batch of 8
rows), all from the HF directory this module writes (model.path):

- 2 ranks, full sharding: ``lora_2``, ``qlora_2`` (tracked in MLflow), each saving a DCP
  checkpoint every 3 steps; ``qlora_2s`` stops after its step-3 save and ``qlora_2r``
  continues it (resume=auto);
- 1 rank: ``lora_1``, ``qlora_1``, and ``qlora_1r``, which resumes ``qlora_2`` on one rank;
- 4 ranks: ``lora_4`` (full sharding) and ``qlora_4`` (hybrid 2 x 2: the tiny shape's k / v
  projections cannot be NF4 over 4 shards, which the spec refuses, tested here too).

Every run exports its PEFT adapter; ``qlora_2`` also the merged model.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llama_fsdp.spec import ConfigError
from tests.conftest import make_spec
from tests.distributed import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 6
BASE = ["eval.every_steps=0", "train.warmup_steps=1", f"train.max_steps={STEPS}",
        "precision=fp32", "finetune.rank=8", "finetune.alpha=16"]
PROBE = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(7))
# 1 rank against 2 or 4: the same sums in another order (reduce-scatters, smaller GEMMs)
RTOL = 1e-4


def _logits(model):
    from llama_fsdp.attention import model_inputs

    with torch.no_grad():
        inputs = model_inputs(model, {"input_ids": PROBE}, torch.device("cpu"))
        return model(**inputs).logits.float().numpy().copy()


def _base(model) -> dict[str, list[torch.Tensor]]:
    """This rank's frozen weights (every inner tensor of an NF4 one), copied."""
    from llama_fsdp import nf4
    from llama_fsdp.lora import is_adapter

    out = {}
    for name, p in model.named_parameters():
        if not is_adapter(name):
            local = p.to_local() if hasattr(p, "to_local") else p
            out[name] = [t.clone() for t in (nf4.inner_tensors(local) if nf4.is_nf4(local)
                                             else [local.detach()])]
    return out


def _nf4_equals_whole_tensor_quantized(model, hf_dir: str) -> bool:
    """Each rank's NF4 shard is the shard of to_nf4(whole HF weight): the per-shard
    quantization with the shared scaler mean is exact."""
    from safetensors.torch import load_file

    from llama_fsdp import nf4
    from llama_fsdp.lora import local_rows, lora_modules

    full = {}
    for f in Path(hf_dir).glob("*.safetensors"):
        full.update(load_file(str(f)))
    for name, m in lora_modules(model):
        p = m.weight
        local = p.to_local() if hasattr(p, "to_local") else p
        start, rows = local_rows(p)
        ref = nf4.nf4_module().to_nf4(full[f"{name}.weight"].to(p.dtype).contiguous(),
                                      local.block_size, local.scaler_block_size)
        shard = torch.chunk(ref, p.shape[0] // rows)[start // rows]
        if not all(torch.equal(a, b) for a, b in zip(nf4.inner_tensors(local),
                                                     nf4.inner_tensors(shard))):
            return False
    return True


def _session(rank, world, specs):
    """Build, check, train and probe every run in turn (one process group per world size)."""
    from llama_fsdp.worker import DistEnv, RankRun

    env, cpu = DistEnv(rank, rank, world, world), torch.device("cpu")
    out = {}
    for name, spec in specs.items():
        run = RankRun.build(spec, env, cpu)
        staging = None
        if spec.finetune.nf4:  # the base again, to read the 16-bit staging it held
            from llama_fsdp.checkpoint.peft import load_hf_base

            staging = load_hf_base(run.model, spec.model.path, spec.finetune,
                                   device=cpu)["staging_bytes"]
        before = _base(run.model)
        nf4_exact = (spec.finetune.nf4
                     and _nf4_equals_whole_tensor_quantized(run.model, spec.model.path))
        trained = {id(p) for p in run.model.parameters() if p.requires_grad}
        optimized = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
        result = run.train()
        after = _base(run.model)
        out[name] = {
            "result": result, "logits": _logits(run.model), "nf4_exact": nf4_exact,
            "staging": staging,
            "base_unchanged": before.keys() == after.keys() and all(
                all(torch.equal(a, b) for a, b in zip(before[k], after[k])) for k in before),
            "optimizer_holds_adapters_only": optimized == trained and all(
                "lora_" in n for n, p in run.model.named_parameters() if id(p) in trained)}
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from transformers import LlamaForCausalLM

    from llama_fsdp.data import build_tokenizer
    from llama_fsdp.model import llama_config

    spec = make_spec()
    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    LlamaForCausalLM(llama_config(spec.model)).save_pretrained(path)
    build_tokenizer(spec.data, tmp_path_factory.mktemp("tok-cache")).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf_dir):
    from llama_fsdp.checkpoint import layout
    from llama_fsdp.prepare import prepare

    root = tmp_path_factory.mktemp("adapters")
    store = tmp_path_factory.mktemp("mlflow")

    def spec(name, method, world, *extra, tracked=False):
        track = (f"tracking.uri=sqlite:///{store}/mlflow.db" if tracked
                 else "tracking.enabled=false")
        return make_spec([*BASE, f"model.path={hf_dir}", f"finetune={method}", track,
                          f"cluster.nproc_per_node={world}", f"train.batch_size={8 // world}",
                          *extra], output_dir=root / name)

    saving = "save.every_steps=3"
    two = {"lora_2": spec("lora_2", "lora", 2, saving),
           "qlora_2": spec("qlora_2", "qlora", 2, saving, "finetune.export_merged=true",
                           tracked=True)}
    # stopped after its step-3 save, then continued in the same directory (resume=auto)
    two["qlora_2s"] = spec("qlora_2r", "qlora", 2, saving, "train.stop_after=3")
    two["qlora_2r"] = spec("qlora_2r", "qlora", 2, saving, "resume=auto")
    prepare(two["qlora_2"], command="pytest")  # its MLflow run, as the driver makes it
    out = run_ranks(_session, 2, two)
    step3 = layout.step_dir(root / "qlora_2", 3)
    one = {"lora_1": spec("lora_1", "lora", 1), "qlora_1": spec("qlora_1", "qlora", 1),
           "qlora_1r": spec("qlora_1r", "qlora", 1, f"resume={step3}")}
    out0 = {**out[0], **run_ranks(_session, 1, one)[0]}
    four = {"lora_4": spec("lora_4", "lora", 4),
            "qlora_4": spec("qlora_4", "qlora", 4, "sharding=hybrid", "sharding.shard_size=2")}
    out4 = run_ranks(_session, 4, four)
    out0.update(out4[0])
    return {"rank0": out0, "ranks": {"2": out, "4": out4}, "hf": hf_dir,
            "specs": {**two, **one, **four}, "root": root}


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_loss_falls_and_ranks_agree(runs, method):
    for world in ("2", "4"):
        per_rank = [r[f"{method}_{world}"]["result"].losses for r in runs["ranks"][world]]
        assert all(c == per_rank[0] for c in per_rank), f"{method} {world} ranks disagree"
    losses = runs["rank0"][f"{method}_1"]["result"].losses
    assert len(losses) == STEPS and losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_one_rank_equals_two_and_four(runs, method):
    r = runs["rank0"]
    one = r[f"{method}_1"]["result"].losses
    for world in (2, 4):
        torch.testing.assert_close(r[f"{method}_{world}"]["result"].losses, one, rtol=RTOL,
                                   atol=0, msg=f"{method}: {world} ranks vs 1")
    assert runs["specs"][f"{method}_4"].mesh.shard == (2 if method == "qlora" else 4)


def test_qlora_at_four_shards_of_the_tiny_shape_is_refused_with_the_fix(hf_dir):
    with pytest.raises(ConfigError) as e:
        make_spec(["finetune=qlora", "cluster.nproc_per_node=4"])
    msg = str(e.value)
    assert "k_proj, v_proj cannot be stored in NF4 over 4 shard(s)" in msg
    assert "a shard group of 1, 2 rank(s)" in msg and "finetune=lora" in msg


def test_the_frozen_base_is_bit_identical_after_training(runs):
    for name, r in runs["rank0"].items():
        assert r["base_unchanged"], name  # (qlora_2r's base: rebuilt from the HF files)
        assert r["optimizer_holds_adapters_only"], name


def test_nf4_shards_equal_the_whole_tensor_quantized(runs):
    for name, r in runs["rank0"].items():
        if name.startswith("qlora"):
            assert r["nf4_exact"], name
    for rank_result in runs["ranks"]["2"] + runs["ranks"]["4"]:
        assert all(v["nf4_exact"] for k, v in rank_result.items() if k.startswith("qlora"))


def test_loading_stages_one_layers_rows_as_the_plan_says(runs):
    """No rank holds more than one decoder layer's target rows in 16 bits while loading the
    NF4 base (plan/host.py's staging_bytes; fp32 here, the frozen dtype of precision=fp32)."""
    from llama_fsdp.plan.host import staging_bytes

    for world, results in (("2", runs["ranks"]["2"]), ("4", runs["ranks"]["4"])):
        for r in results:
            spec = runs["specs"][f"qlora_{world}"]
            assert r[f"qlora_{world}"]["staging"] == staging_bytes(spec) > 0
    # tiny (h 256, kv 128, i 768) over 2 shards: (2 x 256 + 2 x 128 + 3 x 768) x 256 / 2 rows
    assert staging_bytes(runs["specs"]["qlora_2"]) == (2 * 256 + 2 * 128 + 3 * 768) * 256 // 2 * 4


def test_convert_says_where_an_adapter_checkpoint_s_model_is(runs):
    from llama_fsdp.checkpoint import layout
    from llama_fsdp.convert import convert

    with pytest.raises(ValueError, match="holds LoRA adapters only"):
        convert(layout.step_dir(runs["root"] / "qlora_2", 3), runs["root"] / "converted")


def test_resume_is_exact_and_works_on_another_world_size(runs):
    r = runs["rank0"]
    full = r["qlora_2"]["result"].losses
    assert r["qlora_2r"]["result"].losses == full[3:]  # same world size: bit-exact
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
    from llama_fsdp import nf4

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
    from llama_fsdp.rundir import RunDir

    merged = _hf_model(RunDir(runs["root"] / "qlora_2").export_merged)
    with torch.no_grad():
        got = merged(input_ids=PROBE).logits.numpy()
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(
        runs["rank0"]["qlora_2"]["logits"]), rtol=1e-4, atol=1e-4)


def test_the_adapter_is_the_logged_model_and_the_counts_are_columns(runs):
    from mlflow.tracking import MlflowClient

    from llama_fsdp.tracking.view import SELECTED, round_to

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
    assert run.data.metrics["trainable pct"] == round_to(100 * trainable / total, 3)
    assert {"metrics.`trainable M`", "metrics.`trainable pct`", "metrics.`base M`"} <= \
        set(SELECTED)
