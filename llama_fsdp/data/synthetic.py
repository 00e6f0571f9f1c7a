"""The synthetic instruction task: the embedded default data (no download) and the project
tokenizer's training corpus."""
from __future__ import annotations

import random
from typing import Callable

from ..config.schema import DataConfig

#
# Short instruction → answer records ("<s> Opposite hot = | cold </s>": 6-10 tokens with the
# compact default template, ~15 per 128-token row) that the tiny 3.4M-parameter Llama starts to
# solve within the default 60 steps of 16 x 128 tokens. The kinds need different skills, so the
# exact match rises at different speeds and keeps headroom:
#   opposite, next_letter  lookups whose key is the only varying prompt token: learnt first
#                          (~0.4-0.95 exact match after 60 steps);
#   add                    single-digit sums, a 100-entry table over two keys (~0.1);
#   copy, reverse          2-3 words: position-based (induction-like) attention and unseen
#                          combinations in the held-out split (~0 at 60 steps, later).
# The lookups are sampled most often, so the metric moves within the budget. Held-out records
# are drawn from another stream of the same seed; the small lookup tables necessarily repeat
# training keys, the word tasks mostly do not.

_WORDS = ("cat dog sun moon tree fish bird star rain snow wind fire rock leaf ship king "
          "frog lamp bell cake drum gold milk rose salt wolf").split()
_OPPOSITES = dict(pair.split(":") for pair in (
    "hot:cold up:down big:small fast:slow old:new day:night left:right open:shut "
    "wet:dry high:low full:empty early:late").split())
_OPPOSITES.update({v: k for k, v in list(_OPPOSITES.items())})
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _opposite(r: random.Random) -> tuple[str, str]:
    w = r.choice(sorted(_OPPOSITES))
    return w, _OPPOSITES[w]


def _next_letter(r: random.Random) -> tuple[str, str]:
    i = r.randrange(len(_LETTERS) - 1)
    return _LETTERS[i], _LETTERS[i + 1]


def _add(r: random.Random) -> tuple[str, str]:
    a, b = r.randrange(10), r.randrange(10)
    return f"{a} + {b}", str(a + b)


def _copy(r: random.Random) -> tuple[str, str]:
    ws = r.sample(_WORDS, r.randint(2, 3))
    return " ".join(ws), " ".join(ws)


def _reverse(r: random.Random) -> tuple[str, str]:
    ws = r.sample(_WORDS, r.randint(2, 3))
    return " ".join(ws), " ".join(reversed(ws))


# kind → (instruction, input/output generator, sampling weight): the quick lookups are the
# most frequent, so the metric moves within the default run's budget.
SYNTHETIC_TASKS: dict[str, tuple[str, Callable[[random.Random], tuple[str, str]], int]] = {
    "opposite": ("Opposite", _opposite, 3),
    "next_letter": ("Next", _next_letter, 3),
    "add": ("Add", _add, 2),
    "copy": ("Copy", _copy, 1),
    "reverse": ("Reverse", _reverse, 1),
}


def synthetic_records(n: int, seed: int, split: str) -> list[dict[str, str]]:
    """``n`` instruction records (instruction/input/output/task), deterministic in (seed, split)."""
    r = random.Random(f"llama_fsdp-synthetic-{seed}-{split}")
    kinds = sorted(SYNTHETIC_TASKS)
    weights = [SYNTHETIC_TASKS[k][2] for k in kinds]
    out = []
    for _ in range(n):
        kind = r.choices(kinds, weights)[0]
        instruction, make, _ = SYNTHETIC_TASKS[kind]
        x, y = make(r)
        out.append({"instruction": instruction, "input": x, "output": y, "task": kind})
    return out


# kind -> a plausible wrong answer to (input, right answer): the rejected answer of a synthetic
# preference pair (objective=dpo), so the preferred answer is known and checkable.
def _wrong_opposite(r: random.Random, x: str, y: str) -> str:
    return r.choice([w for w in sorted(_OPPOSITES) if w != y])


def _wrong_letter(r: random.Random, x: str, y: str) -> str:
    i = _LETTERS.index(x)
    return r.choice([c for c in (_LETTERS[i], _LETTERS[min(i + 2, 25)]) if c != y])


def _wrong_sum(r: random.Random, x: str, y: str) -> str:
    return str(int(y) + 1 if int(y) == 0 or r.random() < 0.5 else int(y) - 1)


def _wrong_order(r: random.Random, x: str, y: str) -> str:
    ws = y.split()
    wrong = " ".join(reversed(ws))
    return wrong if wrong != y else " ".join(ws[1:] + ws[:1])


WRONG_ANSWERS: dict[str, Callable[[random.Random, str, str], str]] = {
    "opposite": _wrong_opposite, "next_letter": _wrong_letter, "add": _wrong_sum,
    "copy": _wrong_order, "reverse": _wrong_order,
}


def synthetic_pairs(n: int, seed: int, split: str, *, prompt_template: str) -> list[dict[str, str]]:
    """``n`` preference records (prompt / chosen / rejected / task): the instruction records of
    ``synthetic_records`` with the right answer chosen and a plausible wrong one rejected (a
    near miss of the same kind: another opposite, a neighbouring letter, a sum off by one, the
    words in the wrong order). Deterministic in (seed, split)."""
    r = random.Random(f"llama_fsdp-synthetic-pairs-{seed}-{split}")
    out = []
    for rec in synthetic_records(n, seed, split):
        prompt = prompt_template.format(instruction=rec["instruction"], input=rec["input"])
        wrong = WRONG_ANSWERS[rec["task"]](r, rec["input"], rec["output"])
        out.append({"prompt": prompt, "chosen": rec["output"], "rejected": wrong,
                    "task": rec["task"]})
    return out


def synthetic_corpus() -> list[str]:
    """The project tokenizer's training text: synthetic records as instructions and chats."""
    d = DataConfig()
    lines = []
    for rec in synthetic_records(3000, seed=0, split="tokenizer"):
        prompt = d.prompt_template.format(instruction=rec["instruction"], input=rec["input"])
        lines.append(f"{prompt} {rec['output']}")
        lines.append(f"<|user|>\n{rec['instruction']} {rec['input']}<|assistant|>\n{rec['output']}")
    return lines

