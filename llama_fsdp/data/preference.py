"""Preference pairs (objective=dpo): prompt / chosen / rejected records, tokenized as two
sequences per pair, packed so that a pair always shares a row.

The layouts are TRL's, told apart by the columns:

- ``prompt``, ``chosen``, ``rejected`` as text (standard, explicit prompt);
- ``chosen``, ``rejected`` as text that share the prompt as a prefix (standard, implicit
  prompt: hh-rlhf's "\\n\\nHuman: ... \\n\\nAssistant: ..."), the prompt being their longest
  common prefix (``extract_prompt``, as TRL's);
- the same with lists of ``{role, content}`` messages (conversational): an explicit prompt of
  messages, or chosen and rejected conversations that share their first turns (binarized
  UltraFeedback: a text ``prompt`` beside whole conversations; the turns are what count).

Text pairs are encoded as SFT's instruction records are (BOS + prompt, then the answer and EOS,
tokenized apart: formats.encode_prompt_response); conversations with the tokenizer's chat
template exactly as SFT's chat records (formats.encode_chat), the loss on the answer's turns
only. Each pair is two tokenized records, chosen then rejected (record 2p and 2p + 1 of a
split). A row of ``train.seq_len`` tokens holds whole pairs: with data.packing as many as fit
(each sequence its own document: positions restart, no attention across them), else one pair
and padding. The log-probs of each sequence are summed from its target tokens
(``PairPacked.batch``'s ``target_index`` / ``target_seq``).

Bad pairs are refused while tokenizing, in the driver, naming the file, the record and the fix:
a missing or empty field, chosen equal to rejected, a prompt that leaves no room for both
answers in a row of train.seq_len.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..config.schema import DataConfig
from .formats import (
    ROW_COLUMNS,
    SHAREGPT_ROLES,
    Encoded,
    _is_messages,
    _is_text,
    _reason,
    describe_columns,
    encode_chat,
    encode_prompt_response,
)
from .packing import Packed, TokenStore, pack

log = logging.getLogger(__name__)

PROMPT, CHOSEN, REJECTED = "prompt", "chosen", "rejected"
# Bump when the pair encoding changes: it is part of the cache key.
_PAIRS_VERSION = 1


@dataclass(frozen=True)
class PairLayout:
    conversational: bool  # lists of messages (else text)
    explicit: bool  # a prompt column of the answers' kind (else the shared prefix)

    def describe(self) -> str:
        kind = "conversational" if self.conversational else "standard"
        return f"pairs ({kind}, {'explicit' if self.explicit else 'implicit'} prompt)"


def detect_layout(features: Any, where: str) -> PairLayout:
    """The pair layout of a split's columns; refuses one without both answers, or with answers of
    different kinds, naming the columns found and the fix."""
    features = dict(features) if not isinstance(features, list) else {c: None for c in features}
    missing = [c for c in (CHOSEN, REJECTED) if c not in features]
    if missing:
        raise ValueError(f"{where}: objective=dpo reads preference pairs, but column(s) {missing} "
                         f"are missing; columns found: {describe_columns(features)}. Expected "
                         "'chosen' and 'rejected' (text or lists of {role, content} messages) "
                         "and optionally 'prompt'. Fix: rename your columns with "
                         "data.preprocess=module:function (docs/dpo.md), or train these "
                         "records with objective=sft")
    kinds = {}
    for c in (CHOSEN, REJECTED, PROMPT):
        f = features.get(c)
        if c not in features:
            continue
        kinds[c] = None if f is None else ("messages" if _is_messages(f) else
                                           "text" if _is_text(f) else "other")
    answer_kinds = {kinds[CHOSEN], kinds[REJECTED]} - {None}
    if "other" in answer_kinds or len(answer_kinds) > 1:
        raise ValueError(f"{where}: 'chosen' and 'rejected' must both be text or both lists of "
                         f"{{role, content}} messages; columns found: "
                         f"{describe_columns(features)}. Fix: reshape the records with "
                         "data.preprocess=module:function")
    conversational = answer_kinds == {"messages"}
    prompt = kinds.get(PROMPT, "absent")
    explicit = prompt is None or prompt == ("messages" if conversational else "text")
    return PairLayout(conversational=conversational, explicit=explicit)


def extract_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a pair whose prompt is their shared prefix (characters of
    text, or turns of a conversation), as TRL's ``extract_prompt``: the prefix up to where they
    first differ, a space there going to the answers."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _messages(value: Any, field: str) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise TypeError(f"field {field!r} must be a list of messages, got {type(value).__name__}")
    out = []
    for m in value:
        if isinstance(m, dict) and m.get("role") is None and m.get("from") is not None:
            m = {"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m.get("value")}
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise TypeError(f"field {field!r}: each message needs string 'role' and 'content' "
                            f"(or ShareGPT's 'from' and 'value'), got {m!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


_SKIP = "fix the record, or leave it out with data.preprocess returning None for it"


def pair_parts(rec: dict[str, Any], layout: PairLayout) -> tuple[Any, Any, Any]:
    """A record's (prompt, chosen, rejected), checked: both answers present and non-empty, of
    the layout's kind, and different."""
    for field in (CHOSEN, REJECTED) + ((PROMPT,) if layout.explicit else ()):
        v = rec.get(field)
        empty_answer = field != PROMPT and (v == "" or v == [])
        if v is None or empty_answer:
            raise ValueError(f"field {field!r} is missing or empty: every pair needs a prompt, a "
                             f"chosen and a rejected answer ({_SKIP})")
    if layout.conversational:
        chosen, rejected = _messages(rec[CHOSEN], CHOSEN), _messages(rec[REJECTED], REJECTED)
        prompt = _messages(rec[PROMPT], PROMPT) if layout.explicit else None
    else:
        for field in (CHOSEN, REJECTED) + ((PROMPT,) if layout.explicit else ()):
            if isinstance(rec[field], bool) or not isinstance(rec[field], (str, int, float)):
                raise TypeError(f"field {field!r} must be text, got {type(rec[field]).__name__}")
        chosen, rejected = str(rec[CHOSEN]), str(rec[REJECTED])
        prompt = str(rec[PROMPT]) if layout.explicit else None
    if chosen == rejected:
        raise ValueError(f"chosen equals rejected: a pair must prefer one answer over another "
                         f"({_SKIP})")
    if prompt is None:
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    if layout.conversational:
        for field, answer in ((CHOSEN, chosen), (REJECTED, rejected)):
            if not any(m["role"] == "assistant" for m in answer):
                raise ValueError(f"the {field} answer has no assistant turn after the prompt's "
                                 f"turns, so nothing to compare ({_SKIP})")
    return prompt, chosen, rejected


def encode_pair(tok: Any, layout: PairLayout, prompt: Any, chosen: Any,
                rejected: Any) -> tuple[Encoded, Encoded]:
    """(chosen, rejected), each the prompt then the answer, the loss mask on the answer."""
    out = []
    for answer in (chosen, rejected):
        if layout.conversational:
            enc = encode_chat(tok, prompt + answer, train_on_prompt=False,
                              targets_from=len(prompt))
        else:
            enc = encode_prompt_response(tok, prompt, answer, train_on_prompt=False)
        out.append(enc)
    return out[0], out[1]


def room_needed(chosen: Encoded, rejected: Encoded) -> int:
    """Tokens a row needs for the pair with one answer token each: both prompts and two."""
    return chosen.prompt_len + rejected.prompt_len + 2


def prompt_budget(seq_len: int) -> int:
    """The tokens a prompt keeps when it leaves no room for the answers (data.overlong=
    truncate): a quarter of the row, half of each sequence's share, as TRL's defaults give a
    prompt half of a sequence (max_prompt_length 512 of max_length 1024)."""
    return max(1, seq_len // 4)


def keep_prompt_end(enc: Encoded, keep: int) -> Encoded:
    """``enc`` with its prompt cut to its last ``keep`` tokens, the end nearest the answer kept
    (TRL's prompt truncation); the answer is untouched."""
    cut = max(0, enc.prompt_len - keep)
    return Encoded(enc.ids[cut:], enc.mask[cut:], enc.prompt_len - cut, enc.chars)


def fit_answers(chosen: Encoded, rejected: Encoded, seq_len: int) -> tuple[int, int]:
    """Lengths the two sequences are cut to so that the pair fits ``seq_len`` tokens: the
    answers share what the prompts leave, a short answer keeping all of its tokens."""
    pc, pr = chosen.prompt_len, rejected.prompt_len
    budget = seq_len - pc - pr
    ac, ar = len(chosen.ids) - pc, len(rejected.ids) - pr
    cap = budget // 2
    if ac <= cap:
        ac, ar = ac, min(ar, budget - ac)
    elif ar <= cap:
        ac, ar = budget - ar, ar
    else:
        ac, ar = budget - cap, cap
    return pc + ac, pr + ar


def _row_seq_len(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class PairEncoder:
    """A batch of pair records -> two token rows per record, chosen then rejected (picklable,
    for ``datasets.map(num_proc=...)``), with the columns cache._tokenize's rows have."""

    tokenizer: Any
    layout: PairLayout
    seq_len: int
    overlong: str
    where: Any

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {k: [] for k in ROW_COLUMNS}
        tasks = batch.get("task")
        for j, index in enumerate(indices):
            rec = {k: v[j] for k, v in batch.items()}
            try:
                pair = encode_pair(self.tokenizer, self.layout, *pair_parts(rec, self.layout))
                keep, fitted, cut = self.fit(*pair, index)
            except Exception as e:  # noqa: BLE001 - any failure is this record's: name it
                raise ValueError(f"{self.where(index)}: {_reason(e)}") from None
            for enc, n, whole in zip(fitted, cut, pair):
                ids, mask = (enc.ids[:n], enc.mask[:n]) if keep else ([], [])
                out["input_ids"].append(ids)
                out["loss_mask"].append(mask)
                out["prompt_len"].append(enc.prompt_len)
                out["truncated"].append(keep and n < len(whole.ids))
                out["full_len"].append(len(whole.ids))
                out["targets"].append(int(sum(mask)))
                out["chars"].append(enc.chars)
                out["keep"].append(keep)
                out["task"].append(str(tasks[j]) if tasks is not None else "")
        return out

    def fit(self, chosen: Encoded, rejected: Encoded,
            index: int) -> tuple[bool, tuple[Encoded, Encoded], tuple[int, int]]:
        """(keep, the pair with its prompts cut if they had to be, the two sequences' lengths)
        in a row of seq_len. A prompt that leaves no room for the answers is cut to its end
        (data.overlong=truncate) or the pair left out (drop); with data.overlong=error, refused,
        as is a pair that does not fit whole."""
        for name, enc in (("chosen", chosen), ("rejected", rejected)):
            if not any(enc.mask):
                raise ValueError(f"the {name} answer has no target token ({_SKIP})")
        need, whole = room_needed(chosen, rejected), len(chosen.ids) + len(rejected.ids)
        if need > self.seq_len and self.overlong == "drop":
            return False, (chosen, rejected), (0, 0)
        if need > self.seq_len and self.overlong == "truncate":
            keep = prompt_budget(self.seq_len)
            chosen, rejected = keep_prompt_end(chosen, keep), keep_prompt_end(rejected, keep)
            whole = len(chosen.ids) + len(rejected.ids)
        elif need > self.seq_len:
            raise ValueError(
                f"the prompt ({chosen.prompt_len} tokens with its template) leaves no room for "
                f"the answers: a row holds the pair, each answer after its own copy of the "
                f"prompt, so it needs at least {need} tokens, and train.seq_len={self.seq_len}. "
                f"Fix: raise train.seq_len (train.seq_len={_row_seq_len(whole)} holds this pair "
                f"whole), shorten the prompt (data.preprocess), or set data.overlong=truncate "
                f"(keeps the prompt's last {prompt_budget(self.seq_len)} tokens) or drop (leaves "
                f"such pairs out)")
        if whole <= self.seq_len:
            return True, (chosen, rejected), (len(chosen.ids), len(rejected.ids))
        if self.overlong == "error":
            raise ValueError(f"the pair is {whole} tokens (chosen {len(chosen.ids)} + rejected "
                             f"{len(rejected.ids)}), longer than a row of train.seq_len="
                             f"{self.seq_len} (data.overlong=error; use truncate or drop, or "
                             f"raise train.seq_len to {_row_seq_len(whole)})")
        if self.overlong == "drop":
            return False, (chosen, rejected), (0, 0)
        return True, (chosen, rejected), fit_answers(chosen, rejected, self.seq_len)


# --- the cache's record kind ------------------------------------------------------------------


class Pairs:
    """Preference pairs as the data cache's record kind (cache.RecordKind)."""

    name = "pairs"

    def fingerprint(self, cfg: DataConfig) -> Any:
        out: dict[str, Any] = {"v": _PAIRS_VERSION}
        if cfg.name == "synthetic":
            from .synthetic import synthetic_pairs

            sample = json.dumps(synthetic_pairs(64, cfg.seed, "train",
                                                prompt_template=cfg.prompt_template))
            out["synthetic"] = hashlib.sha256(sample.encode()).hexdigest()
        return out

    def load(self, cfg: DataConfig, cache_dir: Path) -> tuple[Any, Any]:
        from .sources import load_sources

        if cfg.name != "synthetic":
            return load_sources(cfg, cache_dir)
        import datasets

        from .sources import RecordLocator, Split, _rule, eval_count
        from .synthetic import synthetic_pairs

        out = []
        for split, n in (("train", cfg.num_records),
                         ("eval", eval_count(cfg, cfg.num_records, generated=True))):
            ds = datasets.Dataset.from_list(synthetic_pairs(
                n, cfg.seed, split, prompt_template=cfg.prompt_template))
            where = f"synthetic {split} pairs"
            origin = f"{n} generated pairs" + (f" by {_rule(cfg)}" if split == "eval" else "")
            out.append(Split(ds, RecordLocator(((where, 0, n),)), where, origin))
        return out[0], out[1]

    def tokenize(self, cfg: DataConfig, split: Any, tok: Any, seq_len: int, split_name: str,
                 key: str) -> tuple[Any, dict]:
        from .cache import _empty_tokenized, _spawned_workers, _work_features, split_info

        records = split.records
        if len(records) == 0:
            zeros = np.zeros(0, np.int64)
            return _empty_tokenized(), split_info(split, None, zeros, zeros.astype(bool), zeros,
                                                  zeros.astype(bool), 0, 0)
        layout = detect_layout(records.features, split.name)
        encoder = PairEncoder(tok, layout, seq_len, cfg.overlong, split.where)
        log.info("tokenizing %d %s pairs (%s, num_proc=%d)", len(records), split_name,
                 layout.describe(), cfg.num_proc)
        with _spawned_workers(cfg.num_proc > 1):
            ds = records.map(encoder, batched=True, with_indices=True,
                             remove_columns=records.column_names,
                             num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
                             features=_work_features(), desc=f"tokenizing {split_name} pairs",
                             load_from_cache_file=False,
                             new_fingerprint=f"{key[:32]}-{split_name}")
        table = ds.data.table if hasattr(ds.data, "table") else ds.data

        def pairs(name: str) -> np.ndarray:  # [n_pairs, 2]: chosen, rejected
            return table.column(name).to_numpy(zero_copy_only=False).reshape(-1, 2)

        keep = pairs("keep")[:, 0].astype(bool)
        full_len, targets = pairs("full_len").sum(1), pairs("targets").sum(1)
        truncated = pairs("truncated").astype(bool).any(1)
        tokens = int(np.diff(table.column("input_ids").combine_chunks().offsets.to_numpy()).sum())
        chars = int(pairs("chars").sum())
        ds = ds.remove_columns(["full_len", "targets", "chars", "keep"])
        if not keep.all():
            ds = ds.select(np.nonzero(np.repeat(keep, 2))[0])
        info = split_info(split, layout.describe(), full_len, truncated, targets, keep, chars,
                          tokens)
        if split_name == "train" and not len(ds):
            raise ValueError(f"{split.name}: none of the {len(records)} pairs fits a row of "
                             f"train.seq_len={seq_len} whole (data.overlong=drop): raise "
                             f"train.seq_len (train.seq_len={info['seq_len_for_95']} keeps 95% "
                             "of them whole), or use data.overlong=truncate")
        return ds, info


PAIRS = Pairs()


# --- rows ---------------------------------------------------------------------------------------


@dataclass
class PairPacked(Packed):
    """A split of pairs as rows: row r holds whole pairs, each chosen (record 2p) directly
    followed by its rejected (2p + 1). ``ref_logps``: the reference's summed log-prob of every
    record, when they were computed once (objective.reference=cached)."""

    ref_logps: Optional[np.ndarray] = None

    @classmethod
    def build_pairs(cls, store: TokenStore, seq_len: int, pad_id: int,
                    packing: bool) -> "PairPacked":
        lengths = store.lengths
        pair_len = lengths[0::2] + lengths[1::2]
        rows = pack(pair_len, seq_len) if packing else [[p] for p in range(len(pair_len))]
        row_ptr = np.zeros(len(rows) + 1, dtype=np.int64)
        row_ptr[1:] = np.cumsum([2 * len(r) for r in rows])
        docs = np.fromiter((d for r in rows for p in r for d in (2 * p, 2 * p + 1)),
                           dtype=np.int64, count=int(row_ptr[-1]))
        return cls(store, row_ptr, docs, seq_len, pad_id)

    @property
    def pairs(self) -> int:
        return len(self.store) // 2

    def batch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """Packed.batch's tensors, and where each sequence's targets are:

        - ``target_index`` [n]: flat positions (row * seq_len + t) of the target tokens;
        - ``target_seq`` [n]: the sequence each belongs to, 0 .. 2P-1 (pair k of the batch is
          sequences 2k, chosen, and 2k + 1, rejected);
        - ``seq_records`` [2P]: each sequence's record in the split;
        - ``ref_logps`` [2P] (fp32): the reference's log-prob of each, when cached.
        """
        out = super().batch(rows)
        index, seq, records = [], [], []
        for i, r in enumerate(rows):
            if r < 0:
                continue
            at = i * self.seq_len
            for d in self.docs[self.row_ptr[r]:self.row_ptr[r + 1]]:
                _, m = self.store.record(int(d))
                j = np.flatnonzero(m[1:] > 0)
                index.append(at + j)
                seq.append(np.full(len(j), len(records), dtype=np.int64))
                records.append(int(d))
                at += len(m)
        cat = (lambda parts: np.concatenate(parts).astype(np.int64) if parts  # noqa: E731
               else np.zeros(0, np.int64))
        out["target_index"] = torch.from_numpy(cat(index))
        out["target_seq"] = torch.from_numpy(cat(seq))
        out["seq_records"] = torch.tensor(records, dtype=torch.int64)
        if self.ref_logps is not None:
            out["ref_logps"] = torch.from_numpy(self.ref_logps[records].astype(np.float32))
        return out


class ChosenView:
    """The chosen sequences of a split's store, as a store (the task metric's prompts and
    reference answers: the chosen answer is the right one)."""

    def __init__(self, store: TokenStore):
        self.store = store
        self.prompt_len = store.prompt_len[0::2]
        self.truncated = store.truncated[0::2]

    def __len__(self) -> int:
        return len(self.store) // 2

    def record(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.store.record(2 * i)

    def task(self, i: int) -> str:
        return self.store.task(2 * i)
