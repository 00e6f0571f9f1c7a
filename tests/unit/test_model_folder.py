"""A model is its folder (config/model_folder.py): model.path alone gives the run the folder's
shape, name and size, a recipe for pretrained weights of that size, and refuses what the
project's Llama does not implement; the in-run eval fits real data and states its cost."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llama_fsdp.run.spec import ConfigError
from tests.conftest import make_spec

# A small pretrained-style Llama: SmolLM2's kinds of values (tied, 3 KV heads, rope_theta 1e5)
# at a size a unit test builds in no time; vocab 512 is the project tokenizer's.
SMALL = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 96,
         "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 3,
         "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 1024,
         "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "hidden_act": "silu",
         "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}


def folder(path: Path, **changes) -> Path:
    """config.json (+ a token safetensors file: the spec reads only the config)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**SMALL, **changes}))
    save_file({"x": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


def test_a_folder_alone_gives_the_run_its_shape_name_size_and_a_pretrained_recipe(tmp_path):
    hf = folder(tmp_path / "SmolLM2-mini")
    spec = make_spec([f"model.path={hf}"])
    m = spec.model
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.intermediate_size,
            m.vocab_size, m.tie_word_embeddings, m.rope_theta, m.max_position_embeddings) == \
        (96, 3, 6, 3, 256, 512, True, 100000.0, 1024)
    assert m.name == "SmolLM2-mini" and spec.run_name.startswith("SmolLM2-mini ")
    assert "tiny" not in spec.run_name
    # 512 x 96 embedding (tied) + 3 layers of (2 x 96 x 96 + 2 x 96 x 48 + 3 x 96 x 256 + 2 x 96)
    # + the final norm's 96
    assert spec.overview()["model"] == f"SmolLM2-mini (0.354M parameters, {hf})"
    # what MLflow's params and config artifact hold, and the run's config.yaml
    assert "name: SmolLM2-mini" in spec.config_yaml and "hidden_size: 96" in spec.config_yaml
    assert "tiny" not in spec.config_yaml
    # pretrained weights of under 1B: torchtune's smallest Llama recipe, never the tiny one's
    assert spec.recipe.name == "pretrained <1B full sft" and spec.train.lr == 2e-5
    lora = make_spec([f"model.path={hf}", "finetune=lora"])
    assert lora.overview()["learning rate"] == \
        "3.0e-04 (recipe: pretrained <1B lora sft, by size: 0.00035B parameters)"
    assert (lora.finetune.rank, lora.finetune.alpha) == (64, 128.0)
    # random weights of the same shape (no folder) keep the from-scratch recipe
    assert make_spec(["model.name=mine", "model.hidden_size=96"]).train.lr == 3e-3


@pytest.mark.parametrize("change, says", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
     "is a 'mistral' model (MistralForCausalLM); only Llama models"),
    ({"attention_bias": True}, "attention_bias=true (bias terms in the attention projections)"),
    ({"mlp_bias": True}, "mlp_bias=true (bias terms in the MLP projections)"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'; a Llama MLP gates with silu"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope type is 'yarn', which llama_fsdp does not implement"),
    ({"head_dim": 32}, "head_dim=32, not hidden_size / num_attention_heads = 16"),
])
def test_a_folder_the_project_cannot_train_is_refused_naming_what(tmp_path, change, says):
    hf = folder(tmp_path / "other", **change)
    with pytest.raises(ConfigError) as e:
        make_spec([f"model.path={hf}"])
    assert says in str(e.value)
    with pytest.raises(ConfigError, match="only Llama|bias terms|gates with|does not implement|"
                                          "head_dim"):
        make_spec(["model=1b", f"model.path={hf}", "cluster.device=cpu"])  # named shapes too


def test_exact_match_runs_where_answers_are_short_or_when_asked(tmp_path):
    data = tmp_path / "a.jsonl"
    data.write_text('{"instruction": "x", "output": "y"}\n')
    assert make_spec([]).eval.task_prompts == 64  # the synthetic task: answers of a few tokens
    real = make_spec(["data=jsonl", f"data.path={data}"]).eval
    assert real.task_prompts == 0 and real.max_batches is None  # every held-out row
    assert make_spec(["data=jsonl", f"data.path={data}", "eval.task_prompts=8"]).eval \
        .task_prompts == 8
    with pytest.raises(ConfigError, match=r"eval.max_new_tokens=200 must be in \[1, 128\]"):
        make_spec(["eval.max_new_tokens=200"])  # longer than any training row


def test_the_eval_cost_is_stated_in_training_steps(tmp_path, cache):
    """The plan's estimate from the data's real numbers: the loss over every held-out row is a
    forward each; exact match adds a forward per prompt chunk and per new token."""
    from llama_fsdp.data import build_data
    from llama_fsdp.plan.eval_cost import eval_cost

    spec = make_spec([])
    dm = build_data(spec.data, **{**spec.data_kwargs(dp_rank=0, announce=False),
                                  "cache_dir": cache})
    with_em = eval_cost(spec, dm.stats)
    assert with_em.prompts == 64 and 0 < with_em.new_tokens <= 32
    without = eval_cost(make_spec(["eval.task_prompts=0"]), dm.stats)
    assert without.prompts == 0 and without.loss_batches == with_em.loss_batches >= 1
    assert without.steps < with_em.steps
    assert "no exact match" in without.line(20) and "training steps each" in without.line(20)


def test_a_null_max_batches_keeps_the_loss_within_a_training_step():
    """Every held-out row while that costs at most a step; a held-out set too large for one is
    scored over the rows that fit, and the data's line says how many of how many."""
    from llama_fsdp.plan.eval_cost import fit_eval

    spec = make_spec(["eval.task_prompts=0", "train.batch_size=1"])
    small, cost, left_out = fit_eval(spec, {"eval_rows": 4})
    assert small.eval.max_batches is None and left_out == "" and cost.loss_batches == 2
    big, cost, left_out = fit_eval(spec, {"eval_rows": 40})  # 20 micro-batches a rank
    assert 1 <= big.eval.max_batches < 20 and cost.steps <= 1.0
    assert f"the loss over {big.eval.max_batches} of 20 held-out micro-batches" in left_out
    mine = make_spec(["eval.task_prompts=0", "train.batch_size=1", "eval.max_batches=20"])
    assert fit_eval(mine, {"eval_rows": 40})[0].eval.max_batches == 20  # the user's: kept
