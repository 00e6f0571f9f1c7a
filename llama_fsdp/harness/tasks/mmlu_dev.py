"""The bundled real-data task's documents: MMLU's dev questions (57 subjects, 5 each) as
lm-eval itself ships them, inside its flan chain-of-thought few-shot prompts
(``lm_eval/tasks/mmlu/flan_cot_fewshot/_cot_prompts.json``). Real questions with their
answers, read from the installed lm-eval: a multiple-choice task that runs with no hub."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

PROMPTS = ("mmlu", "flan_cot_fewshot", "_cot_prompts.json")  # under lm-eval's tasks folder
CHOICES = re.compile(r"\(A\)(.*?)\(B\)(.*?)\(C\)(.*?)\(D\)(.*)$", re.S)
ANSWER = re.compile(r"answer is \(([ABCD])\)")


def lm_eval_tasks(reader: str = "the llama_fsdp_mmlu_dev task") -> Path:
    """The installed lm-eval's tasks folder (its task YAMLs and few-shot prompts)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"{reader} reads its questions from lm-eval's package: "
                                "pip install lm-eval")
    return Path(spec.origin).parent / "tasks"


def prompts_file() -> Path:
    f = lm_eval_tasks().joinpath(*PROMPTS)
    if not f.is_file():
        raise FileNotFoundError(f"{f} is not in this lm-eval release: the llama_fsdp_mmlu_dev "
                                "task reads MMLU's dev questions from it")
    return f


def records() -> list[dict[str, Any]]:
    """Each dev question: subject, question, its four choices, the right one's index (label),
    and the worked answer lm-eval's prompt gives it (explanation)."""
    out = []
    for subject, text in json.loads(prompts_file().read_text()).items():
        for block in text.split("\n\nQ: ")[1:]:
            question, _, answer = block.partition("\nA: ")
            choices, label = CHOICES.search(question), ANSWER.search(answer)
            if choices is None or label is None:
                continue  # (one of the 285 writes its choices another way)
            out.append({"subject": subject.replace("_", " "),
                        "question": question[:choices.start()].strip(),
                        "choices": [c.strip() for c in choices.groups()],
                        "label": "ABCD".index(label.group(1)),
                        "explanation": answer.strip()})
    return out


def load(**_: Any):
    """lm-eval's ``custom_dataset``: a DatasetDict with a test split."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(records())})
