"""What the data module tells the user: the split, the tokenizer used, and advice (a tokenizer
made for other text, records cut by train.seq_len, records with nothing to learn)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from ..config.schema import DataConfig
from .tokenizer import PROJECT_VOCAB_SIZE, TokenizerChoice

# Truncating more than this share of a split's records is worth a length report.
MANY_TRUNCATED = 0.05
# Tokens per character of English text that real tokenizers spend (Llama 3: ~0.23-0.27).
REAL_TOKENS_PER_CHAR = 0.25


@dataclass(frozen=True)
class DataInfo:
    """The prepared data in words and numbers: for the log, and for the tracker (``params``)."""

    source: str  # "jsonl: data/train.jsonl", "synthetic", ...
    format: Optional[str]  # of the training records: instruction | chat | text
    tokenizer: str  # the directory or hub name it was loaded from
    tokenizer_source: str  # data.tokenizer | model.path | project
    tokenizer_size: int
    train_records: int
    eval_records: int
    train_origin: str  # "97 of 102 records"
    eval_origin: str  # "held out 5 of 102 records (data.eval_fraction=0.05, ...)"
    tokens_per_char: float  # over every record of both splits, before truncation
    cache_path: str  # the tokenized data's directory
    notes: tuple[tuple[int, str], ...] = field(default=())  # (logging level, message)

    def params(self) -> dict[str, str]:
        """MLflow params of the data as trained (stable across resumes of a run)."""
        return {"derived.tokenizer": self.tokenizer,
                "derived.tokenizer_source": self.tokenizer_source,
                "derived.tokenizer_size": str(self.tokenizer_size),
                "derived.data_format": str(self.format),
                "derived.train_records": str(self.train_records),
                "derived.eval_records": str(self.eval_records),
                "derived.eval_split": self.eval_origin}

    def announce(self, log: logging.Logger) -> None:
        for level, message in self.notes:
            log.log(level, "%s", message)


def ready_line(*, train_rows: int, seq_len: int, efficiency: float, eval_rows: int,
               cache_path: str) -> str:
    """The line the announcing process logs last about its data."""
    return (f"data: {train_rows} training rows of {seq_len} tokens (packing efficiency "
            f"{efficiency:.3f}), {eval_rows} eval rows; cached in {cache_path}")


def describe_source(cfg: DataConfig) -> str:
    if cfg.name == "synthetic":
        return "synthetic"
    return f"{cfg.name}: {cfg.path}" + (f" [{cfg.split}]" if cfg.name == "hf" else "")


def data_notes(cfg: DataConfig, meta: dict[str, Any], info: DataInfo, *, seq_len: int,
               vocab_size: int, repeats: int, rows: int, global_batch: int) -> list[tuple[int, str]]:
    """The messages a run prints once about its data (INFO: facts; WARNING: advice)."""
    tr, ev = meta["train"], meta["eval"]
    split = (f"data {info.source}: {tr['records_in']} training and {ev['records_in']} eval "
             f"records ({info.eval_origin or 'no eval'}); format {info.format}")
    if (tr["records_in"], ev["records_in"]) != (info.train_records, info.eval_records):
        split += (f"; {info.train_records} and {info.eval_records} of them are kept (the others "
                  "are left out: see below)")
    notes = [(logging.INFO, split)]
    tokenizer = (f"data: tokenizer {info.tokenizer} ({info.tokenizer_source}), "
                 f"{info.tokenizer_size} tokens; {info.tokens_per_char:.2f} tokens per character "
                 "of this data")
    notes.append((logging.INFO, tokenizer))
    project = info.tokenizer_source == "project"
    if project and cfg.name != "synthetic":
        notes.append((logging.WARNING,
                      f"data: tokenized with the project tokenizer ({PROJECT_VOCAB_SIZE} pieces, "
                      f"made for the synthetic task): {info.tokens_per_char:.2f} tokens per "
                      "character of this data, where a real model's tokenizer spends about "
                      f"{REAL_TOKENS_PER_CHAR} per character of English (more records cut by "
                      "train.seq_len, slower training). For real data set model.path to the "
                      "Hugging Face model you fine-tune (its tokenizer is used), or "
                      "data.tokenizer=<tokenizer directory or hub name>"))
    if not project and info.tokenizer_size < 0.9 * vocab_size:
        notes.append((logging.WARNING,
                      f"data: the tokenizer has {info.tokenizer_size} tokens but "
                      f"model.vocab_size={vocab_size}: is it the model's own tokenizer? (a "
                      "slightly larger embedding is common; a much larger one usually is not)"))
    for split in ("train", "eval"):
        notes.extend(_split_notes(cfg, split, meta[split], seq_len=seq_len,
                                  project=project, tokens_per_char=info.tokens_per_char))
    if repeats > 1:
        notes.append((logging.WARNING,
                      f"data: {rows} packed training row(s) cannot fill one global batch of "
                      f"{global_batch} (train.batch_size x ranks): every epoch repeats them "
                      f"{repeats} times. Add records, or lower train.batch_size"))
    return notes


def _split_notes(cfg: DataConfig, split: str, m: dict[str, Any], *, seq_len: int, project: bool,
                 tokens_per_char: float) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    n = m["records_in"]
    cut = m["truncated"] + m["dropped"]
    if cut:
        how = "truncated" if m["truncated"] else "dropped"
        text = (f"{split}: {cut} of {n} records ({cut / n:.0%}) are longer than train.seq_len="
                f"{seq_len} tokens and were {how} (data.overlong={cfg.overlong})")
        if cut / n > MANY_TRUNCATED:
            q = m["length"]
            text += (f". Record lengths in tokens: p50 {q['p50']}, p90 {q['p90']}, p95 {q['p95']}"
                     f", p99 {q['p99']}, max {q['max']}; train.seq_len={m['seq_len_for_95']} "
                     "would keep 95% of them whole")
            if project and cfg.name != "synthetic":
                text += (f" (lengths in the project tokenizer's tokens, {tokens_per_char:.2f} per "
                         "character: the model's own tokenizer needs far fewer)")
        out.append((logging.WARNING, text))
    if m["no_target"]:
        text = (f"{split}: {m['no_target']} of {n} records have no target token and are left out"
                + (f" ({m['no_target_truncated']} because truncation to train.seq_len={seq_len} "
                   "cut off the answer: raise train.seq_len)" if m["no_target_truncated"] else ""))
        out.append((logging.WARNING, text))
    if split == "eval" and n and not m["records"]:
        out.append((logging.WARNING, f"eval: none of the {n} eval records is left (see above): "
                                     "no eval loss is measured"))
    return out


def tokenizer_override_note(choice: TokenizerChoice, tok: Any,
                            model_path: Optional[str]) -> Optional[tuple[int, str]]:
    """A warning when data.tokenizer replaces a tokenizer of another vocabulary that model.path
    brings (the same vocabulary with another chat template is a legitimate override)."""
    from pathlib import Path

    from .tokenizer import has_tokenizer_files, load_tokenizer

    if choice.source != "data.tokenizer" or not model_path:
        return None
    local = Path(model_path).expanduser()
    if not (local.is_dir() and has_tokenizer_files(local)):
        return None
    try:
        own = load_tokenizer(str(local), cache_dir=local, source="model.path")
    except ValueError:
        return None
    if own.get_vocab() == tok.get_vocab():
        return None
    return (logging.WARNING,
            f"data: data.tokenizer={choice.name_or_path} replaces model.path's own tokenizer "
            f"({len(own)} tokens) with one of another vocabulary ({len(tok)} tokens): the pretrained "
            "embedding will read ids it was not trained with. Unset data.tokenizer to use the "
            "model's")
