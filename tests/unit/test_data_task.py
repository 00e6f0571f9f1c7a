"""The synthetic task and its metric: greedy exact match on held-out prompts."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaForCausalLM

from llama_fsdp.config import DataConfig, ModelConfig
from llama_fsdp.data import SYNTHETIC_TASKS, _greedy, build_data, greedy_exact_match, synthetic_records
from llama_fsdp.model import llama_config


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "data-cache"


@pytest.fixture(scope="module")
def dm(cache):
    return build_data(DataConfig(num_records=300, eval_records=40), seq_len=128, micro_batch=4,
                      dp_rank=0, dp_world=1, seed=0, cache_dir=cache, vocab_size=512)


class Oracle(torch.nn.Module):
    """Answers every held-out prompt with its reference (or a wrong first token)."""

    def __init__(self, dm, wrong: bool = False):
        super().__init__()
        store, self.vocab, self.pad = dm.eval.store, len(dm.tokenizer), dm.tokenizer.pad_token_id
        self.table = {}
        for i in range(len(store)):
            x, _ = store.record(i)
            p = int(store.prompt_len[i])
            self.table[tuple(x[:p].tolist())] = x[p:].tolist()
        self.wrong, self.calls = wrong, 0

    def forward(self, input_ids, attention_mask, position_ids, use_cache, logits_to_keep):
        self.calls += 1
        out = torch.full((input_ids.shape[0], 1, self.vocab), -1e9)
        for i in range(input_ids.shape[0]):
            ids = input_ids[i][attention_mask[i].bool()].tolist()
            plen = next(n for n in range(len(ids), 0, -1) if tuple(ids[:n]) in self.table)
            answer, k = self.table[tuple(ids[:plen])], len(ids) - plen
            nxt = answer[k] if k < len(answer) else self.pad
            if self.wrong and k == 0:
                nxt = (nxt + 1) % self.vocab
            out[i, 0, nxt] = 0.0
        return SimpleNamespace(logits=out)


def test_synthetic_records_are_deterministic_and_split_apart():
    a = synthetic_records(50, seed=3, split="train")
    assert a == synthetic_records(50, seed=3, split="train")
    assert a != synthetic_records(50, seed=4, split="train")
    assert a != synthetic_records(50, seed=3, split="eval")
    assert {r["task"] for r in synthetic_records(500, 0, "train")} == set(SYNTHETIC_TASKS)
    rev = next(r for r in a if r["task"] == "reverse")
    assert rev["output"].split() == rev["input"].split()[::-1]


def test_synthetic_records_mask_the_prompt(dm):
    tok = dm.tokenizer
    b = next(dm.train_batches())
    ids, labels = b["input_ids"][0], b["labels"][0]
    text = tok.decode(ids[: int((ids == tok.eos_token_id).nonzero()[0]) + 1])
    assert text.startswith("<s>") and " = " in text and text.endswith("</s>")
    first_target = int((labels != -100).nonzero()[0])
    assert tok.decode(ids[: first_target + 1]).endswith(" =")  # targets start after the prompt


def test_oracle_scores_one_and_wrong_scores_zero(dm):
    oracle = Oracle(dm)
    res = dm.evaluate_task(oracle, device="cpu", max_prompts=30)
    assert res["exact_match"] == 1.0
    kinds = {k for k in res if k.startswith("exact_match/")}
    assert kinds <= {f"exact_match/{k}" for k in SYNTHETIC_TASKS}
    assert greedy_exact_match(Oracle(dm, wrong=True), dm, "cpu") == 0.0
    # fixed work: ceil(30 / micro_batch 4) batches x max answer length (+EOS) steps
    longest = max(len(v) for v in list(oracle.table.values()))
    assert oracle.calls == 8 * (longest)


def test_text_data_has_no_task_metric(tmp_path, cache):
    f = tmp_path / "t.jsonl"
    f.write_text("".join(f'{{"text": "line {i} of text"}}\n' for i in range(30)))
    dm = build_data(DataConfig(name="jsonl", path=str(f), eval_records=5), seq_len=64, micro_batch=2,
                    dp_rank=0, dp_world=1, seed=0, cache_dir=cache, vocab_size=512)
    assert dm.evaluate_task(Oracle(dm), device="cpu") == {}


def test_left_padded_batch_decodes_like_one_by_one(dm):
    m = ModelConfig(name="t", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=128, vocab_size=512, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(m)).eval()
    store = dm.eval.store
    prompts = [store.record(i)[0][: int(store.prompt_len[i])] for i in range(6)]
    assert len({len(p) for p in prompts}) > 1  # the batch needs padding
    batched = _greedy(model, prompts, dm.tokenizer, torch.device("cpu"), 5)
    alone = [_greedy(model, [p], dm.tokenizer, torch.device("cpu"), 5)[0] for p in prompts]
    assert batched == alone
