"""The synthetic task: deterministic records, prompt masking."""
from __future__ import annotations

from llama_fsdp.data import SYNTHETIC_TASKS, synthetic_records


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
