"""The bundled task's documents: 200 held-out records of the synthetic instruction task, from
their own stream (split "harness"), never the training or the run's eval records' stream."""
from __future__ import annotations

from typing import Any

DOCS = 200


def load(**_: Any):
    """lm-eval's ``custom_dataset``: a DatasetDict with a test split (extra kwargs: the task's
    metadata, unused)."""
    import datasets

    from llama_fsdp.data.synthetic import synthetic_records

    return datasets.DatasetDict(
        {"test": datasets.Dataset.from_list(synthetic_records(DOCS, seed=0, split="harness"))})


def load_choices(**_: Any):
    """The multiple-choice form (llama_fsdp_synthetic_mc): each held-out record's right answer
    and a plausible wrong one (a near miss of the same kind, as the DPO pairs' rejected answer),
    in an order fixed per record; scored by log-likelihood, as hellaswag and arc are."""
    import random

    import datasets

    from llama_fsdp.data.synthetic import WRONG_ANSWERS, synthetic_records

    r = random.Random("llama_fsdp-harness-choices")
    docs = []
    for rec in synthetic_records(DOCS, seed=0, split="harness"):
        wrong = WRONG_ANSWERS[rec["task"]](r, rec["input"], rec["output"])
        label = r.randrange(2)
        choices = [wrong, rec["output"]] if label else [rec["output"], wrong]
        docs.append({**rec, "choices": choices, "label": label})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})
