"""Every command of README.md and docs/ that needs no SLURM cluster, run as a user types it.

Each test takes its command from the docs through the registry (tests/docs_commands.py:
``docs.command(id)``), with only the changes the registry states for it, and runs it in bash
with this environment activated, in one working directory shared by the module (one
``outputs/``: one MLflow store, one tokenizer and data cache), holding the files the examples
name and a Hugging Face hub cache with a tiny Llama under the hub names. It checks what the
user would see: the run summary, the plan, the sbatch script, the table, the MLflow record.
The SLURM commands that run on a cluster are in test_slurm_docs_commands.py.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from safetensors import safe_open

from llama_fsdp.config.recipes import recipe_values
from llama_fsdp.launchers.environment import free_port
from tests import docs_commands as docs

pytestmark = [pytest.mark.slow]

REPO = docs.REPO
# a preset "of the documented form" (docs/configuration.md): what $EDITOR writes
MY_RUN = """\
# @package _global_
# my_run: ZeRO-2 (sharding=grad_op) on the CPU, two steps, no eval
defaults:
  - override /sharding: grad_op
  - _self_
cluster:
  device: cpu
train:
  max_steps: 2
  warmup_steps: 0
eval:
  every_steps: 0
  task_prompts: 0
data:
  num_records: 400
"""


# --- the shared working directory ---------------------------------------------------------------

# session scope: under xdist a worker may run another module's tests between these, which would
# tear a module fixture down and make it all again


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    """The directory the commands run in, with the files the examples name."""
    cwd = tmp_path_factory.mktemp("docs")
    docs.write_data_files(cwd)
    (cwd / "my_run_preset.yaml").write_text(MY_RUN)
    return cwd


@pytest.fixture(scope="session")
def hub(work) -> Path:
    """The hub cache: a tiny Llama (with the project tokenizer; the Instruct one with its chat
    template) under each hub name of the docs, and ultrachat_200k, also prepared in the datasets
    cache the runs read (outputs/cache/hf_datasets)."""
    hub = work / "hub"
    docs.make_hub_cache(hub, work / "scratch", work / "outputs" / "cache")
    docs.make_dataset_cache(work / "outputs" / "cache" / "hf_datasets", work / "scratch", hub)
    return hub


def fill(work: Path, **more: str) -> dict[str, str]:
    return {"bin": str(docs.BIN), "python": str(docs.BIN / "python"), "venv": str(docs.BIN.parent),
            "work": str(work), "repo": str(REPO), **more}


def run_doc(id: str, cwd: Path, *, timeout: float = 600, work: Path | None = None,
            **placeholders: str) -> docs.Ran:
    """Docs command ``id`` as the registry runs it, in ``cwd`` (``work``: the module's folder,
    when that is not ``cwd``)."""
    cmd, env = docs.command(id, **fill(work or cwd, **placeholders))
    return docs.run(cmd, cwd, env, timeout=timeout)


def client(work: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{work}/outputs/mlflow.db")


def finished(r: docs.Ran, work: Path, steps: int = 2, logged: list[int] | None = None,
             loss: str = "loss"):
    """The run finished all its steps, says so in its summary, and MLflow has it FINISHED with a
    ``loss`` per logged step (every step unless ``logged`` says which; DPO's: dpo_loss);
    returns the MLflow run."""
    assert r.returncode == 0, str(r)
    assert docs.summary_value(r.output, "status") == "finished", str(r)
    assert docs.summary_value(r.output, "steps") == str(steps), str(r)
    run_id = docs.summary_value(r.output, "mlflow run").split()[0]
    c = client(work)
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED"
    losses = [m.step for m in c.get_metric_history(run_id, loss)]
    assert losses == (logged or list(range(1, steps + 1))), losses
    return run


def printed(output: str, key: str) -> str:
    """A value of the spec summary printed before the plan ("[hh:mm:ss] key   value")."""
    m = re.search(rf"^\[[\d:]+\] {re.escape(key)}\s+(.+)$", output, re.M)
    assert m, f"no '{key}' line before the plan:\n{output[-3000:]}"
    return m.group(1).strip()


def plan_gb(output: str, label: str) -> str:
    """The GB column of a row of the printed plan ("  <label>   18.88   17.59")."""
    m = re.search(rf"^  {re.escape(label)}\s+(-?[\d.]+)\s+-?[\d.]+$", output, re.M)
    assert m, f"no plan row {label!r}:\n{output[-3000:]}"
    return m.group(1)


def sweep_table(output: str) -> tuple[list[str], list[str], list[list[str]]]:
    """The summary table a sweep prints: its lines, its header's columns, and its rows."""
    table = output.split(" summary:\n", 1)[1].splitlines()
    header = table[0].split()
    rows = [row.split() for row in itertools.takewhile(lambda row: len(row.split()) == len(header),
                                                        table[2:])]
    return table, header, rows


def doc_states(page: str, pattern: str) -> tuple[str, ...]:
    """What a docs page states: the groups of ``pattern`` (blanks in it match any run of
    blanks or a line break, . any character), so that the test breaks when the page's text
    drifts."""
    text = (REPO / page).read_text(encoding="utf-8")
    m = re.search(pattern.replace(" ", r"\s+"), text, re.S)
    assert m, f"{page} no longer says {pattern!r}"
    return m.groups()


def same(doc: str, printed: str) -> bool:
    """A number written in the docs is the printed one, at the precision the docs write it
    (18.9 for a printed 18.88; 18.88 for 18.88 only)."""
    decimals = [len(x.partition(".")[2]) for x in (doc, printed)]
    if decimals[0] == decimals[1]:
        return float(doc) == float(printed)
    return abs(float(doc) - float(printed)) <= 0.5 * 10 ** -decimals[0] + 0.5 * 10 ** -decimals[1]


# --- README.md ------------------------------------------------------------------------------------


def _recipe(id: str) -> list[str]:
    r = run_doc(id, REPO, timeout=60)
    assert r.returncode == 0, str(r)
    return r.output.splitlines()


def test_make_run_installs_and_runs_the_default():
    lines = _recipe("make_run")
    assert lines.index("bash scripts/install.sh") < lines.index(".venv/bin/python -m llama_fsdp")


def test_make_test_is_what_ci_runs():
    lines = _recipe("make_test")
    pytest_line = next(line for line in lines if " -m pytest " in line)
    assert lines.index("bash scripts/install.sh") < lines.index(pytest_line)
    assert pytest_line.startswith(".venv/bin/python -m pytest") and "-n 2" in pytest_line
    assert "\nmake test\n" in (REPO / ".ci" / "run").read_text()


@pytest.fixture(scope="session")
def default_run(work):
    return run_doc("default", work)


def test_default_command(work, default_run):
    r = default_run
    run = finished(r, work)
    assert "train: 100%" in r.output  # rank 0's progress bar
    assert run.data.params["model.name"] == "tiny"
    assert Path(docs.summary_value(r.output, "run dir")).is_relative_to(work / "outputs" / "runs")
    # (one web worker: it answers in 7 s, not 12; benchmarks/mlflow_ui_startup.md)
    assert docs.summary_value(r.output, "compare runs").startswith(
        f"mlflow ui --backend-store-uri sqlite:///{work}/outputs/mlflow.db --workers 1, then open")


def test_hybrid_two_by_two(work):
    r = run_doc("hybrid", work)
    run = finished(r, work)
    assert printed(r.output, "mesh") == "replicate=2 x shard=2"
    assert run.data.tags["derived.mesh"] == "2x2" and run.data.tags["world_size"] == "4"


def test_mixed_precision_checkpointing_compile(work):
    r = run_doc("mixed_compile", work)
    run = finished(r, work)
    assert printed(r.output, "precision") == "mixed"
    assert printed(r.output, "activation_checkpointing") == "full"
    assert "4 layer(s) checkpointed, compile=True" in r.output
    assert run.data.params["train.compile"] == "True"


def _dry_run_checks(r: docs.Ran, work: Path, before: set[Path]) -> str:
    """A dry run printed the plan and the sbatch script, launched nothing, left nothing."""
    assert r.returncode == 0, str(r)
    assert "plan (per device):" in r.output and "predicted peak" in r.output
    assert "dry_run=true: nothing launched. Would run:\n#!/bin/bash" in r.output
    assert docs.run_dirs(work) == before  # no run directory left behind
    return r.output.split("Would run:\n", 1)[1]


def test_readme_70b_dry_run(work):
    before = docs.run_dirs(work)
    r = run_doc("readme_70b_dry", work, timeout=300)
    script = _dry_run_checks(r, work, before)
    assert printed(r.output, "world_size") == "32 = 4 node(s) x 8"
    # 70b hybrid on 4 x 8 H100s needs more than an H100 has: the plan says so, with the fixes,
    # and the README says beside the example that it shows a refusal, with the plan's figure
    assert "DOES NOT FIT" in r.output and "Cheapest fixes" in r.output
    needs = re.search(r"needs ([\d.]+ GB) per device", r.output).group(1)
    comment = next(line for line in (docs.REPO / "README.md").read_text().splitlines()
                   if "model=70b sharding=hybrid cluster=slurm cluster.nodes=4" in line
                   ).split("#", 1)[1]
    assert "refusal" in comment and f"{needs} per GPU" in comment, comment
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8"):
        assert line in script
    assert "\nsrun " in script


def _local_dry_run_checks(r: docs.Ran, work: Path, before: set[Path], ranks: int) -> None:
    """A dry run for local GPUs this machine lacks: the plan, the ranks it would start, nothing
    launched, nothing left behind."""
    assert r.returncode == 0, str(r)
    assert "plan (per device):" in r.output and "predicted peak" in r.output
    assert (f"dry_run=true: nothing launched. Would run:\n{ranks} local rank process(es) via "
            "submitit's local executor") in r.output, str(r)
    assert printed(r.output, "device") == "cuda (nccl)"
    assert docs.run_dirs(work) == before  # no run directory left behind


def test_qlora_70b_on_four_4090s_dry_run(work):
    """README.md's and docs/finetune.md's headline: 70B QLoRA planned for 4 x RTX 4090."""
    before = docs.run_dirs(work)
    r = run_doc("qlora_70b_dry", work, timeout=300)
    _local_dry_run_checks(r, work, before, ranks=4)
    out = r.output
    assert printed(out, "world_size") == "4 = 1 node(s) x 4"
    assert printed(out, "finetune").startswith("qlora (rank 16, alpha 32")
    assert "  fits with a 10% margin" in out and "DOES NOT FIT" not in out
    peak = plan_gb(out, "predicted peak (max over phases: loss)")
    (readme_peak,) = doc_states("README.md", r"planned for 4 x RTX 4090: ([\d.]+) GB per GPU")
    assert same(readme_peak, peak), (readme_peak, peak)
    doc_peak, phase, capacity = doc_states(
        "docs/finetune.md", r"The plan: ([\d.]+) GB per GPU at its peak \(the (\w+) phase\), "
                            r"which fits a 4090's ([\d.]+) GB")
    assert same(doc_peak, peak) and phase == "loss", (doc_peak, phase, peak)
    assert same(capacity, plan_gb(out, "capacity (rtx4090 (cluster.gpu_type table))"))
    base, state, trainable, share, activations, logits = doc_states(
        "docs/finetune.md", r"Of it, ([\d.]+) GB is the sharded base .*? ([\d.]+) GB the "
                            r"adapters' fp32 gradients and AdamW moments \(([\d.]+) M trainable "
                            r"parameters, ([\d.]+)%\), ([\d.]+) GB activations and ([\d.]+) GB "
                            r"loss buffers")
    assert same(base, plan_gb(out, "base NF4/bfloat16 + adapters float32 (sharded)"))
    adapters_state = (float(plan_gb(out, "gradients (adapters only, float32)"))
                      + float(plan_gb(out, "optimizer (AdamW 2 moments of the adapters, "
                                           "float32)")))
    assert same(state, f"{adapters_state:.2f}"), (state, adapters_state)
    m = re.search(r"^trainable\s+([\d,]+) adapters \(([\d.]+)%\): qlora rank 16", out, re.M)
    assert m, out[-3000:]
    assert same(trainable, f"{int(m.group(1).replace(',', '')) / 1e6:.0f}")
    assert same(share, m.group(2)), (share, m.group(2))
    assert same(activations, plan_gb(out, "activations (b=1, s=2048, AC full)"))
    assert same(logits, plan_gb(out, "loss, chunked (1024 tokens x vocab a chunk)"))


def test_qlora_70b_under_16_gb_dry_run(work):
    """Issue 40's goal for README's 70B QLoRA example: 16 GB per GPU or less, with activation
    offload and the loss 256 tokens a chunk."""
    before = docs.run_dirs(work)
    r = run_doc("qlora_70b_16gb_dry", work, timeout=300)
    _local_dry_run_checks(r, work, before, ranks=4)
    out = r.output
    assert "  fits with a 10% margin" in out and "DOES NOT FIT" not in out
    peak = plan_gb(out, "predicted peak (max over phases: forward)")
    (readme_peak,) = doc_states("README.md", r"the loss 256 tokens a chunk: ([\d.]+) GB per GPU")
    assert same(readme_peak, peak) and float(peak) <= 16.0, (readme_peak, peak)
    assert float(plan_gb(out, "host RAM per rank (activation offload, pinned)")) > 0


def test_sweep(work):
    r = run_doc("sweep", work, timeout=900)
    assert r.returncode == 0, str(r)
    assert r.output.count("status         finished") == 6, str(r)
    # on one host (2 ranks) hybrid is full, and each hybrid point says so
    assert r.output.count("sharding=hybrid with one shard group of all 2 ranks") == 3
    table, header, rows = sweep_table(r.output)
    assert len(rows) == 6, table  # one row per point
    b, s = header.index("train.batch_size"), header.index("sharding.strategy")
    points = {(row[b], row[s]) for row in rows}
    assert points == {(b, s) for b in ("1", "2", "4") for s in ("full", "hybrid")}, table
    assert all(row[header.index("status")] == "FINISHED" for row in rows), table


# --- docs/finetune.md ---------------------------------------------------------------------------


# the adapter rank of random tiny weights (the from-scratch recipe) and of weights from a folder
# (model.path: pretrained, under 1B parameters: the pretrained <1B recipe, torchtune's Llama 3.2 1B)
SCRATCH_RANK = recipe_values("tiny", "lora", False)["rank"]
PRETRAINED_RANK = recipe_values("<1B", "lora", False)["rank"]


def _adapters(r: docs.Ran, work: Path, method: str, loss: str = "loss", rank: int = SCRATCH_RANK):
    """A lora / qlora run finished at its recipe's rank; MLflow has its method, and the trainable
    parameters (the plan's adapter count) are a small part of all; its export is a PEFT adapter,
    logged as the run's model. Returns the MLflow run."""
    run = finished(r, work, loss=loss)
    assert printed(r.output, "finetune").startswith(f"{method} (rank {rank}, alpha {2 * rank}")
    m = re.search(rf"^trainable\s+([\d,]+) adapters \([\d.]+%\): {method} rank {rank}",
                  r.output, re.M)
    assert m, str(r)
    assert run.data.params["finetune.method"] == method
    trainable, total = run.data.metrics["trainable_params"], run.data.metrics["total_params"]
    assert trainable == int(m.group(1).replace(",", "")) and 0 < trainable < total
    export = Path(docs.summary_value(r.output, "run dir")) / "export"
    assert (export / "adapter_config.json").is_file(), str(r)
    assert json.loads((export / "adapter_config.json").read_text())["r"] == rank
    # what it trained is what it exported: the adapter file's weights, rank-r factors
    with safe_open(export / "adapter_model.safetensors", "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    assert sum(a * b for a, b in shapes.values()) == trainable, shapes
    assert all(shape[0] == rank for k, shape in shapes.items() if "lora_A" in k), shapes
    (model_output,) = run.outputs.model_outputs
    assert client(work).get_logged_model(model_output.model_id).model_type == "peft-lora"
    return run


def test_finetune_lora(work):
    r = run_doc("lora", work)
    _adapters(r, work, "lora")
    assert "the base is frozen and NF4" not in r.output


def test_finetune_qlora(work):
    r = run_doc("qlora", work)
    _adapters(r, work, "qlora")
    assert "the base is frozen and NF4" in r.output  # the plan counts the NF4 base


def test_finetune_sweep(work):
    r = run_doc("finetune_sweep", work, timeout=900)
    assert r.returncode == 0, str(r)
    assert r.output.count("status         finished") == 3, str(r)
    table, header, rows = sweep_table(r.output)
    method, status = header.index("finetune.method"), header.index("status")
    assert sorted(row[method] for row in rows) == ["full", "lora", "qlora"], table
    assert all(row[status] == "FINISHED" for row in rows), table
    # side by side in MLflow: the method and what it trains
    c = client(work)
    runs = [c.get_run(run_id) for run_id in re.findall(r"^\s+mlflow run\s+(\w+)", r.output, re.M)]
    trains = {run.data.params["finetune.method"]: (run.data.metrics["trainable_params"],
                                                   run.data.metrics["total_params"])
              for run in runs}
    assert sorted(trains) == ["full", "lora", "qlora"], trains
    assert trains["full"][0] == trains["full"][1]
    assert all(0 < trains[m][0] < trains[m][1] / 10 for m in ("lora", "qlora")), trains
    assert all(run.info.status == "FINISHED" for run in runs)


# --- docs/dpo.md ---------------------------------------------------------------------------------


def _dpo(r: docs.Ran, work: Path, rank: int = SCRATCH_RANK):
    """A DPO run with adapters finished from weights equal to its reference (first loss ln 2),
    and MLflow has what it trains for and the DPO metrics of every step."""
    run = _adapters(r, work, "lora", loss="dpo_loss", rank=rank)  # a chart of its own, not SFT's "loss"
    assert "loss" not in run.data.metrics and "summary/final_loss" not in run.data.metrics
    assert printed(r.output, "objective") == "dpo (beta 0.1, sigmoid, reference model)"
    assert "reference: the policy with its adapters off" in r.output  # the plan says which
    c, run_id = client(work), run.info.run_id
    assert run.data.params["objective.name"] == "dpo"
    assert c.get_metric_history(run_id, "dpo_loss")[0].value == pytest.approx(0.6931472, abs=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy",
                "logps/chosen", "logps/rejected"):
        assert [m.step for m in c.get_metric_history(run_id, key)] == [1, 2], key
    return run


def test_dpo_lora(work):
    _dpo(run_doc("dpo", work), work)


def test_sft_then_dpo(work):
    from transformers import AutoModelForCausalLM

    sft = run_doc("sft_export", work)
    finished(sft, work)
    export = work / "outputs" / "sft" / "export"
    assert AutoModelForCausalLM.from_pretrained(str(export)).config.vocab_size == 512
    dpo = run_doc("dpo_from_sft", work)
    run = _dpo(dpo, work, rank=PRETRAINED_RANK)  # the SFT export is pretrained weights
    assert "(recipe: pretrained <1B lora dpo" in dpo.output, str(dpo)
    assert run.data.tags["derived.tokenizer_source"] == "model.path"
    assert run.data.params["model.path"] == "outputs/sft/export"


def test_dpo_beta_sweep(work):
    r = run_doc("dpo_sweep", work, timeout=900)
    assert r.returncode == 0, str(r)
    assert r.output.count("status         finished") == 2, str(r)
    table, header, rows = sweep_table(r.output)
    beta = header.index("objective.beta")
    assert sorted(row[beta] for row in rows) == ["0.05", "0.5"], table
    assert all(row[header.index("status")] == "FINISHED" for row in rows), table
    c = client(work)
    runs = [c.get_run(run_id) for run_id in re.findall(r"^\s+mlflow run\s+(\w+)", r.output, re.M)]
    assert sorted(run.data.params["objective.beta"] for run in runs) == ["0.05", "0.5"]
    assert all("rewards/accuracy" in run.data.metrics for run in runs)


def test_qlora_70b_from_hub_weights(work, hub):
    r = run_doc("qlora_70b_hub", work, hub=str(hub))
    _adapters(r, work, "qlora", rank=PRETRAINED_RANK)  # hub weights are pretrained
    # the adapter names its base by the hub name, so it loads on another machine
    export = Path(docs.summary_value(r.output, "run dir")) / "export"
    config = json.loads((export / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "meta-llama/Llama-3.1-70B"
    snapshot = "models--meta-llama--Llama-3.1-70B/snapshots/"
    assert re.search(rf"data: tokenizer \S*{snapshot}\S* \(model.path\)", r.output), str(r)
    # each rank reads its rows of the base and quantizes them to NF4 on the rank
    assert re.search(rf"loaded the base from \S*{snapshot}\S* in [\d.]+s \(\d+ NF4 weights "
                     r"quantized per shard\)", r.output), str(r)
    assert printed(r.output, "activation_checkpointing") == "full"
    assert "4 layer(s) checkpointed" in r.output
    assert re.search(r"data: \d+ training rows of 2048 tokens", r.output), str(r)


def test_lora_8b_on_one_4090_dry_run(work):
    before = docs.run_dirs(work)
    r = run_doc("lora_8b_dry", work, timeout=300)
    _local_dry_run_checks(r, work, before, ranks=1)
    assert printed(r.output, "finetune").startswith("lora (rank 8, alpha 16")  # the recipe's
    assert "  fits with a 10% margin" in r.output and "DOES NOT FIT" not in r.output
    peak = plan_gb(r.output, "predicted peak (max over phases: loss)")
    (doc_peak,) = doc_states("docs/finetune.md",
                             r"Llama 3.1 8B with LoRA on one 24 GB GPU, at the recipe's "
                             r"rank 8: ([\d.]+) GB planned")
    assert same(doc_peak, peak), (doc_peak, peak)
    assert plan_gb(r.output, "capacity (rtx4090 (cluster.gpu_type table))") == "25.40"


# --- docs/long_context.md ------------------------------------------------------------------------


def test_long_context_8b_qlora_dry_run(work):
    """README.md's and docs/long_context.md's 8B QLoRA at 32,768 tokens on one 24 GB card."""
    before = docs.run_dirs(work)
    r = run_doc("longctx_8b_dry", work, timeout=300)
    _local_dry_run_checks(r, work, before, ranks=1)
    out = r.output
    assert "  fits with a 10% margin" in out and "DOES NOT FIT" not in out
    assert "  loss, chunked (1024 tokens x vocab a chunk)" in out
    peak = plan_gb(out, "predicted peak (max over phases: layers)")
    (readme_peak,) = doc_states("README.md", r"8B QLoRA at 32,768 tokens on one 24 GB card: "
                                             r"([\d.]+) GB")
    doc_peak, phase, longest = doc_states(
        "docs/long_context.md", r"at 32,768 tokens: ([\d.]+) GB planned, the peak in the (\w+)"
                                r"' backward; the longest that fits is ([\d,]+) tokens")
    assert same(readme_peak, peak) and same(doc_peak, peak) and phase == "layers", peak
    assert f"longest train.seq_len that fits at b=1: {longest}\n" in out


def test_long_context_offload_dry_runs(work):
    before = docs.run_dirs(work)
    r = run_doc("longctx_8b_offload_dry", work, timeout=300)
    script = _dry_run_checks(r, work, before)
    out = r.output
    assert "  fits with a 10% margin" in out and "AC full, inputs offloaded" in out
    peak, pinned, recompute, longest = doc_states(
        "docs/long_context.md", r"65,536 tokens: ([\d.]+) GB on the card and ([\d.]+) GB of "
                                r"pinned host memory; one layer's recompute is ([\d.]+) GB of "
                                r"it, and the longest that fits is ([\d,]+) tokens")
    assert same(peak, plan_gb(out, "predicted peak (max over phases: layers)"))
    assert same(pinned, plan_gb(out, "host RAM per rank (activation offload, pinned)"))
    assert f"one layer's recompute in backward ({recompute} GB)" in out
    assert f"longest train.seq_len that fits at b=1: {longest}\n" in out
    assert "#SBATCH --gpus-per-node=1" in script

    r = run_doc("longctx_70b_offload_dry", work, timeout=300)
    _dry_run_checks(r, work, before)
    peak, pinned = doc_states("docs/long_context.md", r"16,384 tokens: ([\d.]+) GB per card and "
                                                      r"([\d.]+) GB of pinned host memory")
    assert "  fits with a 10% margin" in r.output
    assert same(peak, plan_gb(r.output, "predicted peak (max over phases: layers)"))
    assert same(pinned, plan_gb(r.output, "host RAM per rank (activation offload, pinned)"))

    r = run_doc("longctx_full_loss_dry", work, timeout=300)
    _local_dry_run_checks(r, work, before, ranks=1)
    out = r.output
    peak, chunked, together, longest = doc_states(
        "docs/long_context.md", r"The full loss at 65,536 tokens needs ([\d.]+) GB .*? "
                                r"`train.loss=chunked` \(([\d.]+) GB, not enough alone\), "
                                r"`checkpointing.offload=true`, both together with bf16 "
                                r"\(([\d.]+) GB\), and `train.seq_len=(\d+)`")
    assert "this run would be refused at launch: it does not fit" in out
    assert same(peak, plan_gb(out, "predicted peak (max over phases: loss)"))
    assert f"  - train.loss=chunked (no b x s x vocab logits): {chunked} GB (not enough alone)" in out
    assert (f"  - precision=bf16 train.loss=chunked checkpointing.offload=true: {together} GB"
            in out)
    assert f"  - train.seq_len={longest} (the longest that fits as configured)" in out


# --- docs/optimizer.md, docs/planner.md: 70B on one node of 8 x 80 GB ----------------------------

# the phase of the plan's peak as docs/optimizer.md's table names it
PHASES = {"optimizer step": "optimizer", "layers' backward": "layers"}


def _optimizer_table() -> dict[str, list[str]]:
    """docs/optimizer.md's table of the 70B recipe: optimizer -> (predicted peak, phase of the
    peak, optimizer state, to spare)."""
    rows = {}
    for line in (REPO / "docs" / "optimizer.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 5 and cells[1].endswith(" GB"):
            rows[cells[0]] = cells[1:]
    assert set(rows) == {"AdamW (bf16 moments)", "8-bit moments", "4-bit moments"}, rows
    return rows


def _number(cell: str) -> str:
    m = re.search(r"(-?[\d.]+) GB", cell)
    assert m, cell
    return m.group(1)


def _check_row(row: list[str], out: str, state_label: str) -> str:
    """A row of docs/optimizer.md's table is what the plan printed; returns the usable GB."""
    peak, phase, state, spare = row
    m = re.search(r"^  predicted peak \(max over phases: (\w+)\)\s+([\d.]+)", out, re.M)
    assert m, out[-3000:]
    assert same(_number(peak), m.group(2)) and PHASES[phase] == m.group(1), (row, m.groups())
    assert same(_number(state), plan_gb(out, state_label)), (row, state_label)
    usable = re.search(r"with a 10% margin \(usable ([\d.]+) GB\)", out).group(1)
    assert same(_number(spare), f"{float(usable) - float(m.group(2)):.2f}"), (row, usable)
    assert usable == "76.50"
    (doc_usable,) = doc_states("docs/optimizer.md", r"against ([\d.]+) GB usable")
    assert same(doc_usable, usable)
    return usable


def test_optimizer_70b_adamw_dry_run(work):
    before = docs.run_dirs(work)
    r = run_doc("optim_70b_dry", work, timeout=300)
    script = _dry_run_checks(r, work, before)
    out = r.output
    assert printed(out, "precision") == "bf16" and printed(out, "optimizer") == "adamw"
    assert printed(out, "world_size") == "8 = 1 node(s) x 8"
    assert "  DOES NOT FIT with a 10% margin" in out and "Cheapest fixes" in out
    assert plan_gb(out, "capacity (h100 (cluster.gpu_type table))") == "85.00"
    table = _optimizer_table()
    _check_row(table["AdamW (bf16 moments)"], out, "optimizer (AdamW 2 moments, bfloat16)")
    # the fused AdamW step (CUDA's) holds no temporary: the peak is the layers' backward
    peak = plan_gb(out, "predicted peak (max over phases: layers)")
    adamw, eight, four = doc_states("docs/optimizer.md", r"AdamW needs ([\d.]+) GB per GPU, 8-bit "
                                                         r"moments ([\d.]+) GB, 4-bit ([\d.]+) GB")
    (planner,) = doc_states("docs/planner.md",
                            r"needs ([\d.]+) GB per GPU with AdamW and does not fit")
    assert same(adamw, peak) and same(planner, peak), (adamw, planner, peak)
    # the fixes: 8- and 4-bit moments with their peaks, as the page's comment and table say
    comment = doc_states("docs/optimizer.md", r"the fixes list optim=adamw8bit \(([\d.]+) GB\) "
                                              r"and optim=adamw4bit \(([\d.]+) GB\)")
    for name, bits, doc_peaks in (("adamw8bit", "8", (eight, comment[0])),
                                  ("adamw4bit", "4", (four, comment[1]))):
        m = re.search(rf"^  - optim={name} \({bits}-bit AdamW moments\): ([\d.]+) GB \(fits\)$",
                      out, re.M)
        assert m, out[-3000:]
        row = _number(table[f"{bits}-bit moments"][0])
        assert all(same(x, m.group(1)) for x in (*doc_peaks, row)), (name, doc_peaks, row, m[1])
    for line in ("#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8"):
        assert line in script, script


def test_optimizer_70b_8bit_run(work, hub):
    r = run_doc("optim_70b_8bit", work, hub=str(hub))
    run = finished(r, work)
    _tokenizer_of(r, "meta-llama/Llama-3.1-70B")
    assert printed(r.output, "optimizer") == "adamw8bit"
    assert printed(r.output, "precision") == "bf16"
    assert re.search(r"parameters \(sharded, bfloat16\)", r.output)
    assert _data_line(r.output).startswith("train.jsonl: 950 training and 50 eval records")
    assert "format instruction" in _data_line(r.output)
    assert run.data.params["optim.name"] == "adamw8bit"
    assert run.data.params["optim.bf16_stochastic_round"] == "True"
    assert run.data.params["precision.name"] == "bf16"


# --- docs/benchmarks.md -------------------------------------------------------------------------


def test_setup_peers(work):
    cmd, env = docs.command("setup_peers", **fill(work))
    parse = subprocess.run(["bash", "-n", "benchmarks/setup_peers.sh"], cwd=REPO,
                           capture_output=True, text=True)
    assert parse.returncode == 0, parse.stderr
    if os.environ.get("LLAMA_FSDP_DOCS_INSTALL") != "1":
        pytest.skip("bash benchmarks/setup_peers.sh downloads about 1 GB (torch, accelerate, "
                    "torchtitan, triton): parsed only; LLAMA_FSDP_DOCS_INSTALL=1 runs it")
    r = docs.run(cmd, REPO, {**env, "MAIN_VENV": str(docs.BIN.parent)}, timeout=1800)
    assert r.returncode == 0, str(r)
    import importlib.metadata as md

    versions = dict(line.split(None, 1) for line in r.output.splitlines()[-5:])
    assert versions["torch"] == md.version("torch")
    assert versions["transformers"] == md.version("transformers")
    assert versions["accelerate"] != "not installed"


def test_throughput(work):
    r = run_doc("throughput", REPO, work=work, timeout=900)
    assert r.returncode == 0, str(r)
    rows = [line for line in r.output.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| runner |")
    framework = next(row for row in rows if row.startswith("| llama_fsdp (sharding=full)"))
    floor = next(row for row in rows if row.startswith("| bare FSDP2 loop (floor)"))
    for row in (framework, floor):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[2]) > 0 and cells[-1] == "3"  # median ms/step; 3 steady steps
    assert f"written to {work}/throughput.md" in r.output
    report = (work / "throughput.md").read_text()
    assert "## Results" in report and "CPU:" in report


# --- docs/configuration.md ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def models(work) -> Path:
    """/models/Llama-3.2-1B of the docs: a tiny Llama directory with its tokenizer."""
    out = work / "models"
    docs.tiny_llama_dir(out / "Llama-3.2-1B", work / "outputs" / "cache", chat=False)
    return out


def _own_model_dir(out: Path, tokenizer_cache: Path) -> Path:
    """A small Llama folder of its own shape (not model=tiny's: 2 layers of 64, 3 KV heads of
    6, tied, rope_theta 1e5, as a SmolLM2 is shaped) with the project tokenizer and its chat
    template: what a user's converted model folder holds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llama_fsdp.config.schema import DataConfig
    from llama_fsdp.data import build_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        hidden_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
        intermediate_size=256, vocab_size=512, tie_word_embeddings=True,
        max_position_embeddings=1024, rope_parameters={"rope_type": "default",
                                                       "rope_theta": 100000.0})
    ).save_pretrained(out)
    build_tokenizer(DataConfig(name="synthetic"), tokenizer_cache).save_pretrained(out)
    return out


def test_your_own_model_folder(work):
    from llama_fsdp.config.schema import HarnessConfig
    from llama_fsdp.harness import harness_problems, hub_reachable

    _own_model_dir(work / "models" / "SmolLM2-135M-Instruct", work / "outputs" / "cache")
    r = run_doc("own_model", work)
    run = finished(r, work)
    assert printed(r.output, "model").startswith("SmolLM2-135M-Instruct (0.") and \
        "M parameters" in printed(r.output, "model")
    assert printed(r.output, "learning rate").startswith(
        "3.0e-04 (recipe: pretrained <1B lora sft, by size:")
    assert run.info.run_name.startswith("SmolLM2-135M-Instruct lora ")
    assert (run.data.params["model.name"], run.data.params["model.num_layers"],
            run.data.params["model.hidden_size"]) == ("SmolLM2-135M-Instruct", "2", "96")
    assert re.search(r"plan with the data: eval every 20 steps \(and at step 0\): about "
                     r"[\d.e-]+ training steps each \(held-out loss over \d+ micro-batch\(es\) "
                     r"a rank; no exact match\)", r.output), str(r)
    assert re.search(r"step 0: eval_loss=[\d.]+, eval_time_s=", r.output), str(r)
    # the suggested task runs here: offline, it is the bundled real-data one
    task = docs.summary_value(r.output, "evaluate it").split("--tasks ")[1]
    assert task == ("hellaswag" if hub_reachable() else "llama_fsdp_mmlu_dev")
    assert harness_problems(HarnessConfig(tasks=[task])) == []


def test_experiment_preset(work, models):
    r = run_doc("preset", work, models=str(models))
    run = finished(r, work, logged=[2])  # the preset logs every 10 steps, and the last
    assert printed(r.output, "precision") == "mixed"
    assert printed(r.output, "activation_checkpointing") == "full"
    assert run.data.tags["derived.tokenizer_source"] == "model.path"
    # the preset exports the trained model as an HF directory; it loads in transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = Path(docs.summary_value(r.output, "run dir")) / "export"
    AutoModelForCausalLM.from_pretrained(export)
    assert len(AutoTokenizer.from_pretrained(export)) == 512


def test_own_config_folder(work):
    edit = run_doc("my_conf_edit", work, preset=str(work / "my_run_preset.yaml"))
    assert edit.returncode == 0, str(edit)
    assert (work / "my_conf" / "experiment" / "my_run.yaml").read_text() == MY_RUN
    r = run_doc("my_conf_run", work)
    run = finished(r, work)
    assert printed(r.output, "strategy") == "grad_op"
    assert run.data.params["sharding.strategy"] == "grad_op"


# --- docs/recipes.md ----------------------------------------------------------------------------

PRESETS = {  # preset: (local ranks, its row of docs/recipes.md's table, its recipe)
    "llama3_8b_lora_alpaca": (1, "19.32 GB on a 24 GB card", "3.0e-04 (recipe: 8b lora sft)"),
    "llama3_8b_qlora_long": (1, "21.09 GB", "3.0e-04 (recipe: 8b qlora sft)"),
    "llama3_70b_qlora_4x24gb": (4, "18.98 GB per card", "3.0e-04 (recipe: 70b qlora sft)"),
    "llama3_70b_full_8x80gb": (8, "65.42 GB per GPU", "2.0e-05 (recipe: 70b full sft)"),
    "llama3_8b_sft": (1, "19.32 / 19.49 GB", "3.0e-04 (recipe: 8b lora sft)"),
    "llama3_8b_dpo": (1, "19.32 / 19.49 GB", "5.0e-04 (recipe: 8b lora dpo)"),
}


def test_recipe_presets_dry_runs(work):
    table, outputs = (REPO / "docs" / "recipes.md").read_text(), {}
    for preset, (ranks, stated, lr) in PRESETS.items():
        before = docs.run_dirs(work)
        r = run_doc(f"preset_{preset}", work, timeout=300)
        _local_dry_run_checks(r, work, before, ranks=ranks)
        out = outputs[preset] = r.output
        assert "  fits with a 10% margin" in out and "DOES NOT FIT" not in out, preset
        row = next(line for line in table.splitlines()
                   if line.startswith("| `") and f"`{preset}`" in line.split(" | ")[0])
        assert row.rstrip().endswith(f"| {stated} |"), (preset, row)
        peak = re.search(r"^  predicted peak \(max over phases: \w+\)\s+([\d.]+)", out, re.M)
        peaks = re.findall(r"[\d.]+(?= GB| /)", stated)
        assert peak and peak.group(1) in peaks, (preset, peak and peak.group(1), stated)
        assert printed(out, "learning rate") == lr, preset
        random_base = "without model.path: the adapters train beside a random base"
        assert out.count(random_base) == (0 if "full" in preset else 1), preset
    # the lines docs/recipes.md shows are the 8B LoRA preset's, as printed
    shown = doc_states("docs/recipes.md", r"```\n(\[[\d:]+\] learning rate .*?)\n```")[0]
    for line in shown.splitlines():
        assert line.split("] ", 1)[1] in outputs["llama3_8b_lora_alpaca"], line


def _numbers_aside_but_steps(line: str) -> str:
    """A docs line as a pattern: any number where it has one (losses, ratios: the machine's),
    but the steps it names as written ("steps 3", "at step 3", the "3: " of the losses by
    step): where the run stops is the example's point."""
    parts = re.split(r"(\d[\d.e+-]*)", line)
    return "".join(
        re.escape(part) if i % 2 == 0 or re.search(r"steps?\s+$", parts[i - 1])
        or parts[i + 1].startswith(": ") else r"[-+\d.e]+" for i, part in enumerate(parts))


def test_a_run_that_diverges(work):
    r = run_doc("diverge", work)
    assert r.returncode == 3, str(r)
    assert "Traceback" not in r.output
    block = doc_states("docs/recipes.md", r"```\n(  status         diverged\n.*?)\n```")[0]
    assert re.search(r"^  steps +3$", block, re.M)  # the example's point: it stops at step 3
    for line in block.splitlines():  # each line of the docs' report, its numbers aside
        assert re.search("^" + _numbers_aside_but_steps(line) + "$", r.output, re.M), line
    run_dir = Path(docs.summary_value(r.output, "run dir"))
    assert "Traceback (most recent call last)" in (run_dir / "diverged.txt").read_text()
    run = client(work).get_run(docs.summary_value(r.output, "mlflow run").split()[0])
    assert run.info.status == "FAILED" and run.data.tags["status"] == "diverged"


# --- docs/data.md -------------------------------------------------------------------------------


def _data_line(output: str) -> str:
    m = re.search(r"^\[[\d:]+\] data (jsonl|hf): (.+)$", output, re.M)
    assert m, output[-3000:]
    return m.group(2)


def _tokenizer_of(r: docs.Ran, name: str) -> str:
    """The run tokenized with the hub model's own tokenizer, and its ranks loaded the hub
    model's weights, both from the hub cache's snapshot."""
    snapshot = f"models--{name.replace('/', '--')}/snapshots/"
    assert re.search(rf"data: tokenizer \S*{snapshot}\S* \(model.path\)", r.output), str(r)
    assert re.search(rf"loaded \d+ tensors from \S*{snapshot}", r.output), str(r)
    return snapshot


def test_alpaca_records_with_a_hub_model(work, hub):
    r = run_doc("alpaca", work, hub=str(hub))
    run = finished(r, work)
    _tokenizer_of(r, "meta-llama/Llama-3.2-1B")
    assert "format instruction" in _data_line(r.output)
    assert "114 training and 6 eval records" in _data_line(r.output)
    assert run.data.tags["derived.tokenizer_source"] == "model.path"


def test_chat_records_with_a_hub_model(work, hub):
    r = run_doc("chats", work, hub=str(hub))
    finished(r, work)
    _tokenizer_of(r, "meta-llama/Llama-3.2-1B-Instruct")
    line = _data_line(r.output)
    assert line.startswith("chats/*.jsonl: 114 training and 6 eval"), line  # both files' 120
    assert "format chat" in line


def test_hub_dataset_with_a_hub_model(work, hub):
    r = run_doc("ultrachat", work, hub=str(hub))
    finished(r, work)
    _tokenizer_of(r, "meta-llama/Llama-3.2-1B-Instruct")
    line = _data_line(r.output)
    assert line.startswith(f"{docs.HUB_DATASET} [train_sft]: 60 training and 8 eval records"), line
    assert "data.eval_split=test_sft" in line and "format chat" in line


def test_preprocess_hook(work):
    r = run_doc("hook", work)
    finished(r, work)
    n = docs.seed_instances(work)
    m = re.search(r"seed_tasks.jsonl: (\d+) training and (\d+) eval records", _data_line(r.output))
    assert m and int(m.group(1)) + int(m.group(2)) == n > 40, _data_line(r.output)


# --- docs/planner.md, docs/slurm.md: SLURM jobs for GPUs, planned here ---------------------------


def test_planner_dry_run(work):
    before = docs.run_dirs(work)
    r = run_doc("planner_dry", work, timeout=300)
    script = _dry_run_checks(r, work, before)
    assert printed(r.output, "precision") == "bf16"
    assert printed(r.output, "world_size") == "16 = 2 node(s) x 8"
    assert re.search(r"parameters \(sharded, bfloat16\)", r.output)
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=8" in script


def test_planner_70b_8bit_dry_run(work):
    before = docs.run_dirs(work)
    r = run_doc("planner_8bit_dry", work, timeout=300)
    script = _dry_run_checks(r, work, before)
    out = r.output
    assert printed(out, "optimizer") == "adamw8bit" and printed(out, "precision") == "bf16"
    assert "  fits with a 10% margin" in out and "DOES NOT FIT" not in out
    assert plan_gb(out, "capacity (a100 (cluster.gpu_type table))") == "85.00"
    peak = plan_gb(out, "predicted peak (max over phases: layers)")
    (doc_peak,) = doc_states("docs/planner.md", r"with 8-bit moments it needs ([\d.]+) GB and fits")
    assert same(doc_peak, peak), (doc_peak, peak)
    # README's example says the same (its AdamW figure is planner.md's, checked against the
    # printed plan in test_optimizer_70b_adamw_dry_run)
    readme_peak, readme_adamw = doc_states(
        "README.md", r"8-bit AdamW moments fit \(([\d.]+) GB per GPU; AdamW needs ([\d.]+)\)")
    (doc_adamw,) = doc_states("docs/planner.md", r"needs ([\d.]+) GB per GPU with AdamW")
    assert same(readme_peak, peak) and readme_adamw == doc_adamw, (readme_peak, readme_adamw)
    # docs/optimizer.md: 8-bit moments on an H100 node, "cluster.gpu_type=a100: the same"
    usable = _check_row(_optimizer_table()["8-bit moments"], out,
                        "optimizer (AdamW 8-bit moments, block 256)")
    (spare,) = doc_states("docs/optimizer.md", r"8-bit moments: fits with ([\d.]+) GB to spare")
    assert same(spare, f"{float(usable) - float(peak):.2f}"), (spare, peak)
    assert "#SBATCH --nodes=1" in script and "#SBATCH --gpus-per-node=8" in script


def test_slurm_gpu_job(work):
    as_written, e = docs.entry("slurm_gpu")
    _, env = docs.apply(as_written, e, **fill(work))
    before = docs.run_dirs(work)
    refused = docs.run(as_written, work, env, timeout=300)
    assert refused.returncode == 2, str(refused)
    assert "cluster=slurm but sbatch is not on PATH" in refused.output
    assert docs.run_dirs(work) == before
    r = run_doc("slurm_gpu", work, timeout=300)
    script = _dry_run_checks(r, work, before)
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --account=myacct", "#SBATCH --time=240"):
        assert line in script, script
    assert "\nmodule load cuda\n" in script


# --- docs/mlflow.md -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def offline_run(work, port, default_run):
    """A run whose tracking server was down: with tracking.allow_offline=true it trains, and
    its events wait in its run directory (the situation docs/mlflow.md describes)."""
    r = docs.run(f"python -m llama_fsdp {docs.SHRINK.text} {docs.SYNTH.text} "
                 f"tracking.uri=http://127.0.0.1:{port} tracking.allow_offline=true "
                 "tracking.final_delivery_s=1", work)
    assert r.returncode == 0, str(r)
    assert "training anyway (tracking.allow_offline=true)" in r.output
    assert "not in MLflow yet" in r.output
    return Path(docs.summary_value(r.output, "run dir"))


@pytest.fixture(scope="session")
def mlflow_ui(work, port, offline_run):
    """`mlflow ui` of docs/mlflow.md, on its free port, until the session ends."""
    cmd, env = docs.command("mlflow_ui", **fill(work, port=str(port)))
    proc = docs.start(cmd, work, env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "mlflow ui did not answer in 120 s"
            time.sleep(0.5)
        yield url
    finally:
        docs.stop(proc)


def test_mlflow_ui(work, default_run, mlflow_ui):
    run_id = docs.summary_value(default_run.output, "mlflow run").split()[0]
    exp = client(work).get_run(run_id).info.experiment_id
    # the runs page the summary names, on this port
    page = docs.summary_value(default_run.output, "compare runs").split("then open ")[1]
    assert page.startswith(f"http://127.0.0.1:5000/#/experiments/{exp}/runs")
    with urllib.request.urlopen(page.replace("127.0.0.1:5000", mlflow_ui.split("//")[1]),
                                timeout=30) as answer:
        assert answer.status == 200 and "<title>MLflow</title>" in answer.read().decode()
    # what the page shows comes from the server's API: the runs of this store
    body = json.dumps({"experiment_ids": [exp], "max_results": 1000}).encode()
    req = urllib.request.Request(f"{mlflow_ui}/ajax-api/2.0/mlflow/runs/search", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as answer:
        runs = json.loads(answer.read())["runs"]
    assert run_id in {r["info"]["run_id"] for r in runs}


def test_deliver_later(work, offline_run, mlflow_ui):
    r = run_doc("deliver", work, run_dir=str(offline_run.relative_to(work)))
    assert r.returncode == 0, str(r)
    m = re.search(rf"delivered \d+ bytes of events to {re.escape(mlflow_ui)} \(run (\w+)\); 0 left",
                  r.output)
    assert m, str(r)
    c = client(work)
    run = c.get_run(m.group(1))
    assert run.info.status == "FINISHED"
    assert [x.step for x in c.get_metric_history(run.info.run_id, "loss")] == [1, 2]


# --- docs/launching.md ------------------------------------------------------------------------------


def test_torchrun_on_one_host(work):
    r = run_doc("torchrun_one_host", work, port=str(free_port()), timeout=900)
    finished(r, work)
    assert docs.summary_value(r.output, "run dir") == str(
        work / "outputs" / "runs" / "torchrun-llama8b")
    assert r.output.count("status         finished") == 1  # rank 0 speaks for the job


def test_torchrun_on_two_hosts(work, port, mlflow_ui):
    cmd, env = docs.command("torchrun_two_hosts",
                            **fill(work, port=str(free_port()), ui_port=str(port)))
    agents = [docs.start(cmd, work, env) for _ in range(2)]
    outs = [a.communicate(timeout=900)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n=====\n".join(o[-3000:] for o in outs)
    out = "".join(outs)
    assert out.count("status         finished") == 1
    assert "world_size                     4 = 2 node(s) x 2" in out
    run_id = docs.summary_value(out, "mlflow run").split()[0]
    server = MlflowClient(tracking_uri=mlflow_ui)
    run = server.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["precision.name"] == "bf16"
    assert [m.step for m in server.get_metric_history(run_id, "loss")] == [1, 2]
