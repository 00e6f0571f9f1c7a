"""Tables committed under benchmarks/ that are generated, not measured, stay current."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import plan_seed_table

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_classic_budget_table_file_is_current():
    from llama_fsdp.plan import _varlen_repeats_kv

    if _varlen_repeats_kv():
        pytest.skip("the table is of a torch whose varlen_attn takes grouped-query k/v (>= 2.12)")
    table = plan_seed_table.seed_table_markdown()
    assert (BENCHMARKS / "plan_seed_table.md").read_text() == table
    assert "| 8.03 | 16.06 |" in table  # Llama 3.1 8B: 8.03B parameters, 16.06 GB in bf16


@pytest.mark.parametrize("attn", ["auto", "varlen", "sdpa", "eager"])
def test_peers_build_the_framework_model_shape(attn):
    """The harness hands the peers the model node llama_fsdp composes (benchmarks/
    throughput.py, shape.json); they build it with transformers' own attention, never
    llama_fsdp's auto / varlen names, which transformers refuses."""
    import dataclasses

    import torch
    from transformers import LlamaForCausalLM

    from benchmarks.peers.common import llama_config
    from llama_fsdp.config import model_preset

    shape = {**dataclasses.asdict(model_preset("tiny")), "attn_implementation": attn}
    model = LlamaForCausalLM(llama_config(shape))
    assert model.config._attn_implementation == ("sdpa" if attn in ("auto", "varlen") else attn)
    assert model(input_ids=torch.zeros(1, 8, dtype=torch.long)).logits.shape[-1] == shape[
        "vocab_size"]
