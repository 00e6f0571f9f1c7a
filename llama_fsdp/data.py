"""Data: records → tokens with a loss mask → packed rows → per-rank micro-batches.

The worker's interface:

- ``build_data(cfg, *, seq_len, micro_batch, dp_rank, dp_world, seed, cache_dir, vocab_size)``
  returns a ``DataModule``; every rank calls it. Tokenized data is cached under
  ``cache_dir/data`` (keyed by source, tokenizer, seq_len and format options) and built by one
  process under a file lock with an atomic rename, so concurrent ranks are safe. Calling
  ``prepare_data`` on rank 0 before a barrier is optional: it only moves the work (and its
  progress display) to rank 0.
- ``DataModule.train_batches()`` yields this rank's micro-batches forever: ``input_ids``,
  ``labels`` (already shifted: ``labels[:, t]`` is the target of position t, -100 where no loss
  is taken) and ``position_ids`` (restarting at every packed record). Every key except
  ``labels`` goes to the model. Packed records do not attend to each other: transformers
  (``masking_utils.find_packed_sequence_indices``) derives a block-causal mask from position
  ids that restart, as long as no ``attention_mask`` and no KV cache is passed.
- ``DataModule.eval_batches(max_batches)``, ``state_dict()`` / ``load_state_dict()``,
  ``stats``, ``tokenizer``, and ``evaluate_task(model, device=...)`` (greedy exact match on
  held-out prompts; collective: every rank must call it).
"""
from __future__ import annotations

import bisect
import glob
import hashlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from .config import DataConfig
from .tokenizer import (
    encode_chat,
    encode_prompt_response,
    encode_text,
    load_tokenizer,
    tokenizer_fingerprint,
)

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
# Bump when tokenization or the cached layout changes: it is part of the cache key.
_CACHE_VERSION = 1
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv",
                  ".txt": "text"}


# --- the synthetic task -------------------------------------------------------------------------
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


def synthetic_corpus() -> list[str]:
    """The project tokenizer's training text: synthetic records as instructions and chats."""
    d = DataConfig()
    lines = []
    for rec in synthetic_records(3000, seed=0, split="tokenizer"):
        prompt = d.prompt_template.format(instruction=rec["instruction"], input=rec["input"])
        lines.append(f"{prompt} {rec['output']}")
        lines.append(f"<|user|>\n{rec['instruction']} {rec['input']}<|assistant|>\n{rec['output']}")
    return lines


# --- sources -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RecordLocator:
    """Names a record for error messages: the file it came from and its row there."""

    parts: tuple[tuple[str, int, int], ...]  # (source, first global index, count)

    def __call__(self, index: int) -> str:
        for src, start, count in self.parts:
            if start <= index < start + count:
                return f"{src}: record {index - start} (0-based)"
        return f"record {index}"


@dataclass
class Split:
    records: Any  # a datasets.Dataset
    where: Callable[[int], str]  # record index → "file: record i"
    name: str  # the source, for errors about the whole split


def _load_files(spec: str, cache_dir: Path) -> Split:
    """Local files through ``datasets.load_dataset(<builder>, data_files=...)``, one by one."""
    import datasets

    files = _resolve_files(spec)
    parts, loaded, start = [], [], 0
    for f in files:
        if os.path.getsize(f) == 0:
            raise ValueError(f"{f}: empty file (no records)")
        builder = _FILE_BUILDERS[Path(f).suffix.lower()]
        try:
            ds = datasets.load_dataset(builder, data_files=f, split="train",
                                       cache_dir=str(cache_dir / "hf_datasets"))
        except Exception as e:  # noqa: BLE001 - diagnosed and re-raised with the file named
            raise _diagnose_load_error(f, e) from e
        if len(ds) == 0:
            raise ValueError(f"{f}: empty file (no records)")
        loaded.append(ds)
        parts.append((f, start, len(ds)))
        start += len(ds)
    try:
        records = datasets.concatenate_datasets(loaded) if len(loaded) > 1 else loaded[0]
    except ValueError as e:
        raise ValueError(f"data.path={spec!r}: the files do not share one set of columns: {e}") from e
    return Split(records, RecordLocator(tuple(parts)), ", ".join(files))


def _resolve_files(spec: str) -> list[str]:
    p = Path(spec).expanduser()
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.suffix.lower() in _FILE_BUILDERS)
    else:
        files = sorted(glob.glob(str(p))) if any(c in spec for c in "*?[") else [str(p)]
    if not files:
        raise FileNotFoundError(f"data.path={spec!r}: no data files there "
                                f"(looked for {', '.join(_FILE_BUILDERS)})")
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"data.path={spec!r}: {f} does not exist")
        if Path(f).suffix.lower() not in _FILE_BUILDERS:
            raise ValueError(f"{f}: unsupported file type; use one of {', '.join(_FILE_BUILDERS)}")
    return files


def _diagnose_load_error(path: str, err: Exception) -> Exception:
    """Find the malformed line of a JSON-lines file; otherwise name the file."""
    if Path(path).suffix.lower() in (".jsonl", ".json"):
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        try:
            json.loads(text)  # a single JSON document (array / object) parses as a whole
        except json.JSONDecodeError:
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except json.JSONDecodeError as e:
                    return ValueError(f"{path}: line {n}: malformed JSON ({e.msg}, column {e.colno})")
    return ValueError(f"{path}: cannot be read as a dataset: {type(err).__name__}: {err}")


def _load_hub(cfg: DataConfig, split: str, cache_dir: Path) -> Split:
    """``datasets.load_dataset(path, subset, split=...)``: a hub name, or a local directory
    (data files, a loading script's repo layout, or a ``save_to_disk`` output)."""
    import datasets

    path = cfg.path
    assert path is not None
    where = f"{path}[{split}]"
    p = Path(path).expanduser()
    try:
        if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
        else:
            ds = datasets.load_dataset(path, name=cfg.subset, split=split, revision=cfg.revision,
                                       cache_dir=str(cache_dir / "hf_datasets"))
    except KeyError as e:
        raise ValueError(f"data.path={path!r}: no split {split!r}") from e
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"data.path={path!r} (split {split!r}) cannot be loaded with "
                         f"datasets.load_dataset: {type(e).__name__}: {e}") from e
    if len(ds) == 0:
        raise ValueError(f"{where}: empty split (no records)")
    return Split(ds, RecordLocator(((where, 0, len(ds)),)), where)


def _load_sources(cfg: DataConfig, cache_dir: Path) -> tuple[Split, Split]:
    """(train, eval) records; eval_records are held out of train when no eval source is named."""
    import datasets

    match cfg.name:
        case "synthetic":
            tr = datasets.Dataset.from_list(synthetic_records(cfg.num_records, cfg.seed, "train"))
            ev = datasets.Dataset.from_list(synthetic_records(cfg.eval_records, cfg.seed, "eval"))
            return (Split(tr, RecordLocator((("synthetic train", 0, len(tr)),)), "synthetic train"),
                    Split(ev, RecordLocator((("synthetic eval", 0, len(ev)),)), "synthetic eval"))
        case "jsonl":
            train = _load_files(cfg.path, cache_dir)
            if cfg.eval_path:
                return train, _load_files(cfg.eval_path, cache_dir)
        case "hf":
            train = _load_hub(cfg, cfg.split, cache_dir)
            if cfg.eval_split:
                return train, _load_hub(cfg, cfg.eval_split, cache_dir)
        case _:
            raise ValueError(f"data.name={cfg.name!r}: valid: {', '.join(DataConfig.SOURCES)}")
    return _hold_out(train, cfg.eval_records, cfg.seed)


def _hold_out(train: Split, n_eval: int, seed: int) -> tuple[Split, Split]:
    n = len(train.records)
    if n_eval >= n:
        raise ValueError(f"data.eval_records={n_eval} leaves no training records "
                         f"({n} records in total); lower it or name an eval split / file")
    perm = np.random.default_rng(seed).permutation(n)
    ev_idx, tr_idx = np.sort(perm[:n_eval]), np.sort(perm[n_eval:])
    return (Split(train.records.select(tr_idx), _Remapped(train.where, tr_idx), train.name),
            Split(train.records.select(ev_idx), _Remapped(train.where, ev_idx),
                  f"{train.name} (held out)"))


class _Remapped:
    """A locator for a selection: position in the selection → original record."""

    def __init__(self, where: Callable[[int], str], idx: np.ndarray):
        self.where, self.idx = where, idx

    def __call__(self, i: int) -> str:
        return self.where(int(self.idx[i]))


# --- formats: records → ids + loss mask ----------------------------------------------------------

def detect_format(cfg: DataConfig, columns: list[str], where: str) -> str:
    """The record format: as configured, or by the columns present; checks the columns exist."""
    need = {"instruction": [cfg.instruction_column, cfg.output_column],
            "chat": [cfg.messages_column], "text": [cfg.text_column]}
    fmt = cfg.format
    if fmt == "auto":
        fmt = next((f for f in ("chat", "instruction", "text") if all(c in columns for c in need[f])),
                   None)
        if fmt is None:
            raise ValueError(
                f"{where}: cannot tell the record format from columns {sorted(columns)}; expected "
                f"{cfg.messages_column!r} (chat), {cfg.instruction_column!r}+{cfg.output_column!r} "
                f"(instruction) or {cfg.text_column!r} (text). Set data.format and the "
                "data.*_column names")
    elif fmt not in need:
        raise ValueError(f"data.format={fmt!r}: valid: {', '.join(DataConfig.FORMATS)}")
    missing = [c for c in need[fmt] if c not in columns]
    if missing:
        raise ValueError(f"{where}: format {fmt!r} needs column(s) {missing} (data.*_column); "
                         f"the records have columns {sorted(columns)}")
    return fmt


@dataclass(frozen=True)
class Encoder:
    """Turns a batch of records into ``input_ids`` / ``loss_mask`` / ``prompt_len`` rows
    (picklable, for ``datasets.map(num_proc=...)``)."""

    tokenizer: Any
    fmt: str
    cfg: DataConfig
    seq_len: int
    where: Any

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "loss_mask": [], "prompt_len": [], "truncated": [],
                                "task": []}
        tasks = batch.get("task")
        for j, index in enumerate(indices):
            try:
                ids, mask, prompt_len = self.encode({k: v[j] for k, v in batch.items()})
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"{self.where(index)}: {e}") from None
            truncated = len(ids) > self.seq_len
            if truncated:
                if self.cfg.overlong == "error":
                    raise ValueError(f"{self.where(index)}: {len(ids)} tokens, longer than "
                                     f"train.seq_len={self.seq_len} (data.overlong=error; "
                                     "use truncate or drop, or raise train.seq_len)")
                if self.cfg.overlong == "drop":
                    continue
                ids, mask = ids[:self.seq_len], mask[:self.seq_len]
                prompt_len = min(prompt_len, self.seq_len)
            out["input_ids"].append(ids)
            out["loss_mask"].append(mask)
            out["prompt_len"].append(prompt_len)
            out["truncated"].append(truncated)
            out["task"].append(str(tasks[j]) if tasks is not None else "")
        return out

    def encode(self, rec: dict[str, Any]) -> tuple[list[int], list[int], int]:
        c, tok = self.cfg, self.tokenizer
        match self.fmt:
            case "instruction":
                instruction, output = _text(rec, c.instruction_column), _text(rec, c.output_column)
                inp = rec.get(c.input_column) or ""
                if not isinstance(inp, str):
                    raise TypeError(f"field {c.input_column!r} must be a string, "
                                    f"got {type(inp).__name__}")
                prompt = (c.prompt_template.format(instruction=instruction, input=inp) if inp
                          else c.prompt_template_no_input.format(instruction=instruction))
                return encode_prompt_response(tok, prompt, output, train_on_prompt=c.train_on_prompt)
            case "chat":
                return encode_chat(tok, _messages(rec, c.messages_column),
                                   train_on_prompt=c.train_on_prompt)
            case "text":
                return encode_text(tok, _text(rec, c.text_column))
        raise ValueError(f"unknown format {self.fmt!r}")


def _text(rec: dict[str, Any], col: str) -> str:
    v = rec.get(col)
    if not isinstance(v, str):
        raise TypeError(f"field {col!r} is missing or not a string (got {type(v).__name__})")
    return v


def _messages(rec: dict[str, Any], col: str) -> list[dict[str, str]]:
    msgs = rec.get(col)
    if not isinstance(msgs, list) or not msgs:
        raise TypeError(f"field {col!r} must be a non-empty list of messages")
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise TypeError(f"field {col!r}: each message needs string 'role' and 'content', got {m!r}")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError(f"field {col!r}: no assistant turn, so nothing to learn")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


# --- tokenize once, cache ------------------------------------------------------------------------

@dataclass
class Prepared:
    """Tokenized train / eval splits (datasets, memory-mapped) and what building them found."""

    train: Any
    eval: Any
    meta: dict[str, Any]
    from_cache: bool
    path: Path


def prepare_data(cfg: DataConfig, *, seq_len: int, cache_dir: Path, tokenizer=None,
                 show_progress: bool = True) -> Prepared:
    """Tokenize both splits into ``cache_dir/data/<key>`` or find them there.

    Rank-safe: the first process to take the lock builds into a temporary directory and
    renames it into place; the others wait for the lock and load the result.
    """
    cfg, cache_dir = _as_config(cfg), Path(cache_dir)
    tok = tokenizer if tokenizer is not None else build_tokenizer(cfg, cache_dir)
    key = _cache_key(cfg, seq_len, tok)
    root = cache_dir / "data"
    final = root / f"{cfg.name}-{key[:20]}"
    if not (final / "meta.json").exists():
        from filelock import FileLock

        root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(root / f"{final.name}.lock")):
            if not (final / "meta.json").exists():
                _build(cfg, seq_len, tok, cache_dir, final, show_progress)
                return _load_prepared(final, from_cache=False)
    log.info("tokenized data found in cache: %s", final)
    return _load_prepared(final, from_cache=True)


def build_tokenizer(cfg: DataConfig, cache_dir: Path):
    """The configured tokenizer, or the project tokenizer trained on the synthetic corpus."""
    return load_tokenizer(cfg.tokenizer, cache_dir=Path(cache_dir), corpus=synthetic_corpus)


def _as_config(cfg) -> DataConfig:
    """A DataConfig from a composed DictConfig node too (the worker may pass either)."""
    if isinstance(cfg, DataConfig):
        return cfg
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), cfg))


def _cache_key(cfg: DataConfig, seq_len: int, tok) -> str:
    fields = {f: getattr(cfg, f) for f in (
        "name", "num_records", "eval_records", "seed", "path", "subset", "revision", "split",
        "eval_split", "eval_path", "format", "instruction_column", "input_column",
        "output_column", "messages_column", "text_column", "prompt_template",
        "prompt_template_no_input", "train_on_prompt", "overlong")}
    if cfg.name != "synthetic":  # generation options do not apply to files / hub data
        fields.pop("num_records")
    blob = {"v": _CACHE_VERSION, "cfg": fields, "seq_len": seq_len,
            "tokenizer": tokenizer_fingerprint(tok), "files": _source_stamp(cfg)}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def _source_stamp(cfg: DataConfig) -> list:
    """Size and mtime of every local source file, so edited files are tokenized again (for
    synthetic data: a sample of the generator's output, so changed tasks are too)."""
    if cfg.name == "synthetic":
        sample = json.dumps([synthetic_records(64, cfg.seed, s) for s in ("train", "eval")])
        return [hashlib.sha256(sample.encode()).hexdigest()]
    stamps = []
    for spec in (cfg.path, cfg.eval_path):
        if not spec:
            continue
        p = Path(spec).expanduser()
        paths = (sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir()
                 else [Path(f) for f in sorted(glob.glob(str(p)))])
        for f in paths:
            st = f.stat()
            stamps.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return stamps


def _build(cfg: DataConfig, seq_len: int, tok, cache_dir: Path, final: Path,
           show_progress: bool) -> None:
    import datasets

    meta: dict[str, Any] = {"name": cfg.name, "seq_len": seq_len, "tokenizer": tok.name_or_path}
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    was_enabled = datasets.is_progress_bar_enabled()
    if not show_progress:
        datasets.disable_progress_bars()
    try:
        train, ev = _load_sources(cfg, cache_dir)
        for split_name, split in (("train", train), ("eval", ev)):
            ds, info = _tokenize(cfg, split, tok, seq_len, split_name, final.name)
            if len(ds):  # (datasets cannot reload an empty saved dataset: absent means empty)
                ds.save_to_disk(str(tmp / split_name))
            meta[split_name] = info
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        os.replace(tmp, final)
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
        shutil.rmtree(tmp, ignore_errors=True)


def _tokenize(cfg: DataConfig, split: Split, tok, seq_len: int, split_name: str,
              key: str) -> tuple[Any, dict]:
    records = split.records
    if len(records) == 0:
        return _empty_tokenized(), {"records": 0, "format": None, "truncated": 0, "dropped": 0,
                                    "tokens": 0}
    fmt = detect_format(cfg, list(records.column_names), split.name)
    encoder = Encoder(tok, fmt, cfg, seq_len, split.where)
    log.info("tokenizing %d %s records (%s format, num_proc=%d)", len(records), split_name, fmt,
             cfg.num_proc)
    ds = records.map(encoder, batched=True, with_indices=True, remove_columns=records.column_names,
                     num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
                     features=_tokenized_features(), desc=f"tokenizing {split_name}",
                     load_from_cache_file=False, new_fingerprint=f"{key[:32]}-{split_name}")
    truncated = int(sum(ds["truncated"]))
    dropped = len(records) - len(ds)
    if truncated or dropped:
        log.warning("%s: %d record(s) longer than seq_len=%d were %s", split_name,
                    truncated or dropped, seq_len, "truncated" if truncated else "dropped")
    lengths = _lengths(ds)
    return ds, {"records": len(ds), "format": fmt, "truncated": truncated, "dropped": dropped,
                "tokens": int(lengths.sum())}


def _tokenized_features():
    from datasets import Features, Sequence, Value

    return Features({"input_ids": Sequence(Value("int32")), "loss_mask": Sequence(Value("int8")),
                     "prompt_len": Value("int32"), "truncated": Value("bool"),
                     "task": Value("string")})


def _empty_tokenized():
    import datasets

    return datasets.Dataset.from_dict({k: [] for k in _tokenized_features()},
                                      features=_tokenized_features())


def _load_prepared(path: Path, *, from_cache: bool) -> Prepared:
    import datasets

    meta = json.loads((path / "meta.json").read_text())
    train, ev = ((datasets.load_from_disk(str(path / s)) if (path / s).exists() else _empty_tokenized())
                 for s in ("train", "eval"))
    return Prepared(train=train, eval=ev, meta=meta, from_cache=from_cache, path=path)


# --- packing -------------------------------------------------------------------------------------

class TokenStore:
    """A tokenized split as flat arrays: record i is ``ids[offsets[i]:offsets[i+1]]``."""

    def __init__(self, ds):
        self._table = table = ds.data.table if hasattr(ds.data, "table") else ds.data
        ids = table.column("input_ids").combine_chunks()
        mask = table.column("loss_mask").combine_chunks()
        self.offsets = ids.offsets.to_numpy().astype(np.int64)
        self.ids = ids.values.to_numpy(zero_copy_only=False)
        self.mask = mask.values.to_numpy(zero_copy_only=False)
        self.prompt_len = table.column("prompt_len").to_numpy()
        self.truncated = table.column("truncated").to_numpy(zero_copy_only=False)

    def task(self, i: int) -> str:
        """The record's task kind ("" if the source has no ``task`` column)."""
        return self._table.column("task")[i].as_py()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def record(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.mask[a:b]


def _lengths(ds) -> np.ndarray:
    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    return np.diff(table.column("input_ids").combine_chunks().offsets.to_numpy())


def pack(lengths: np.ndarray, seq_len: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing of records (by length) into rows of ``seq_len`` tokens.

    Every record lands in exactly one row, whole; deterministic (ties by record index).
    """
    if len(lengths) and int(lengths.max()) > seq_len:
        raise ValueError(f"a record of {int(lengths.max())} tokens does not fit seq_len={seq_len}")
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (remaining capacity, row), sorted
    smallest = int(lengths.min()) if len(lengths) else 1
    for d in np.argsort(-lengths, kind="stable"):
        n = int(lengths[d])
        k = bisect.bisect_left(free, (n, -1))
        if k == len(free):
            rows.append([int(d)])
            cap, row = seq_len - n, len(rows) - 1
        else:
            cap, row = free.pop(k)
            rows[row].append(int(d))
            cap -= n
        if cap >= smallest:
            bisect.insort(free, (cap, row))
    return rows


@dataclass
class Packed:
    """A split as rows of records: row r holds records ``docs[row_ptr[r]:row_ptr[r+1]]``."""

    store: TokenStore
    row_ptr: np.ndarray
    docs: np.ndarray
    seq_len: int
    pad_id: int

    @classmethod
    def build(cls, store: TokenStore, seq_len: int, pad_id: int, packing: bool) -> "Packed":
        rows = pack(store.lengths, seq_len) if packing else [[i] for i in range(len(store))]
        row_ptr = np.zeros(len(rows) + 1, dtype=np.int64)
        row_ptr[1:] = np.cumsum([len(r) for r in rows])
        docs = np.fromiter((d for r in rows for d in r), dtype=np.int64, count=int(row_ptr[-1]))
        return cls(store, row_ptr, docs, seq_len, pad_id)

    def __len__(self) -> int:
        return len(self.row_ptr) - 1

    @property
    def efficiency(self) -> float:
        """Non-pad tokens / all tokens in the rows."""
        return float(self.store.lengths.sum()) / max(1, len(self) * self.seq_len)

    def batch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """Rows → ``input_ids`` / ``labels`` (shifted) / ``position_ids``, each [len(rows), seq_len].

        A negative row id gives a dummy row (all pad, no labels) that keeps shapes and the
        number of batches equal across ranks.
        """
        b, t = len(rows), self.seq_len
        ids = np.full((b, t), self.pad_id, dtype=np.int64)
        labels = np.full((b, t), IGNORE_INDEX, dtype=np.int64)
        pos = np.tile(np.arange(t, dtype=np.int64), (b, 1))
        for i, r in enumerate(rows):
            if r < 0:
                continue
            at = 0
            for d in self.docs[self.row_ptr[r]:self.row_ptr[r + 1]]:
                x, m = self.store.record(int(d))
                n = len(x)
                ids[i, at:at + n] = x
                labels[i, at:at + n - 1] = np.where(m[1:] > 0, x[1:], IGNORE_INDEX)
                pos[i, at:at + n] = np.arange(n)
                at += n
            # padding continues the last record's positions, so it forms no extra segment
            pos[i, at:] = np.arange(n, n + t - at)
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(pos)}


# --- per-rank batches ----------------------------------------------------------------------------

class DataModule:
    """This rank's view of the packed data: train batches (stateful), eval batches, task metric."""

    def __init__(self, *, train: Packed, eval: Packed, tokenizer, micro_batch: int, dp_rank: int,
                 dp_world: int, seed: int, stats: dict[str, float]):
        self.train, self.eval, self.tokenizer = train, eval, tokenizer
        self.micro_batch, self.dp_rank, self.dp_world, self.seed = micro_batch, dp_rank, dp_world, seed
        self._stats = stats
        self.position = {"epoch": 0, "index": 0}
        self._order_cache: tuple[int, np.ndarray] | None = None
        if self.batches_per_epoch < 1:
            raise ValueError(f"{len(train)} packed training rows cannot fill one global batch of "
                             f"{micro_batch} x {dp_world} ranks; add data or lower train.batch_size")

    @property
    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches per rank per epoch (the tail that cannot fill a global batch is skipped)."""
        return len(self.train) // (self.micro_batch * self.dp_world)

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's permutation of training rows (same on every rank; seed + epoch)."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.train))
            self._order_cache = (epoch, perm)
        return self._order_cache[1]

    def train_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's micro-batches forever; ``position`` counts global rows used this epoch.

        Each global batch is ``micro_batch x dp_world`` consecutive rows of the epoch order, and
        rank r takes the r-th slice, so ranks are disjoint and together cover the epoch.
        """
        glob_b = self.micro_batch * self.dp_world
        while True:
            epoch, index = self.position["epoch"], self.position["index"]
            if index + glob_b > len(self.train):
                self.position = {"epoch": epoch + 1, "index": 0}
                continue
            start = index + self.dp_rank * self.micro_batch
            rows = self.order(epoch)[start:start + self.micro_batch]
            self.position = {"epoch": epoch, "index": index + glob_b}
            yield self.train.batch(rows)

    def eval_batches(self, max_batches: Optional[int] = None) -> list[dict[str, torch.Tensor]]:
        """This rank's held-out micro-batches: the same count and shapes on every rank.

        Ranks take consecutive blocks of eval rows, filled up with dummy rows (no labels) to
        whole micro-batches: every eval row counts once, ranks stay in lockstep for FSDP, and
        every batch has the training shape (no recompiles).
        """
        per_rank = math.ceil(len(self.eval) / self.dp_world / self.micro_batch) * self.micro_batch
        rows = np.arange(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
        rows[rows >= len(self.eval)] = -1
        out = []
        for i in range(0, per_rank, self.micro_batch):
            if max_batches is not None and len(out) >= max_batches:
                break
            out.append(self.eval.batch(rows[i:i + self.micro_batch]))
        return out

    def state_dict(self) -> dict[str, int]:
        return {**self.position, "rows": len(self.train)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rows = int(state.get("rows", len(self.train)))
        if rows != len(self.train):
            log.warning("loader state is for %d training rows, this data has %d: resuming at the "
                        "start of epoch %d", rows, len(self.train), int(state["epoch"]) + 1)
            self.position = {"epoch": int(state["epoch"]) + 1, "index": 0}
            return
        self.position = {"epoch": int(state["epoch"]), "index": int(state["index"])}

    def evaluate_task(self, model, *, device: torch.device | str, max_prompts: Optional[int] = 64,
                      max_new_tokens: Optional[int] = None,
                      batch_size: Optional[int] = None) -> dict[str, float]:
        """Greedy answers to held-out prompts, scored by exact match (overall and per task kind).

        Collective: every rank must call it (each answers its own share of prompts with the
        same number of forward calls; counts are summed across ranks). {} if the eval split
        has no prompt/answer records (plain text).
        """
        return _evaluate_task(self, model, device=torch.device(device), max_prompts=max_prompts,
                              max_new_tokens=max_new_tokens,
                              batch_size=batch_size or self.micro_batch)


def greedy_exact_match(model, data: DataModule, device: torch.device | str,
                       max_new_tokens: Optional[int] = None, max_prompts: Optional[int] = 64) -> float:
    """Fraction of held-out prompts whose greedy answer equals the reference (all ranks call it)."""
    return data.evaluate_task(model, device=device, max_prompts=max_prompts,
                              max_new_tokens=max_new_tokens).get("exact_match", float("nan"))


# --- the task metric -----------------------------------------------------------------------------

def _task_prompts(store: TokenStore, tok,
                  max_prompts: Optional[int]) -> list[tuple[np.ndarray, str, str, int]]:
    """(prompt ids, reference answer, task kind, answer tokens) for eval records with an intact
    answer, in eval-split order."""
    out = []
    for i in range(len(store)):
        if max_prompts is not None and len(out) >= max_prompts:
            break
        p = int(store.prompt_len[i])
        if p <= 0 or store.truncated[i]:
            continue
        x, _ = store.record(i)
        answer = tok.decode(x[p:].tolist(), skip_special_tokens=True).strip()
        out.append((x[:p], answer, store.task(i) or "all", len(x) - p))
    return out


@torch.no_grad()
def _evaluate_task(data: DataModule, model, *, device: torch.device, max_prompts: Optional[int],
                   max_new_tokens: Optional[int], batch_size: int) -> dict[str, float]:
    tok = data.tokenizer
    prompts = _task_prompts(data.eval.store, tok, max_prompts)
    if not prompts:
        return {}
    if max_new_tokens is None:
        max_new_tokens = max(p[3] for p in prompts)  # the longest answer, with its EOS
    kinds = sorted({p[2] for p in prompts})
    per_rank = math.ceil(len(prompts) / data.dp_world)
    mine = list(range(data.dp_rank * per_rank, (data.dp_rank + 1) * per_rank))
    correct = torch.zeros(2, len(kinds), dtype=torch.float64)  # [correct, total] per kind
    was_training = model.training
    model.eval()
    try:
        for i in range(0, per_rank, batch_size):
            chunk = mine[i:i + batch_size]
            real = [j for j in chunk if j < len(prompts)]
            # ranks past the end answer a stand-in prompt, uncounted, to keep forward calls equal
            batch = [prompts[j if j < len(prompts) else 0][0] for j in chunk]
            answers = _greedy(model, batch, tok, device, max_new_tokens)
            for j, ans in zip(chunk, answers):
                if j in real:
                    k = kinds.index(prompts[j][2])
                    correct[0, k] += float(ans == prompts[j][1])
                    correct[1, k] += 1
    finally:
        model.train(was_training)
    correct = _all_reduce_sum(correct, device)
    out = {"exact_match": float(correct[0].sum() / correct[1].sum())}
    if len(kinds) > 1:
        out.update({f"exact_match/{k}": float(correct[0, i] / correct[1, i])
                    for i, k in enumerate(kinds) if correct[1, i] > 0})
    return out


def _greedy(model, prompts: list[np.ndarray], tok, device: torch.device, steps: int) -> list[str]:
    """Left-padded batched greedy decoding for exactly ``steps`` forward calls (no KV cache)."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.from_numpy(p.astype(np.int64))
        mask[i, longest - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    new = []
    for _ in range(steps):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                       logits_to_keep=1).logits[:, -1]
        nxt = logits.argmax(-1).masked_fill(done, tok.pad_token_id)
        done |= nxt == tok.eos_token_id
        new.append(nxt)
        ids = torch.cat([ids, nxt[:, None]], 1)
        mask = torch.cat([mask, torch.ones_like(nxt)[:, None]], 1)
    gen = torch.stack(new, 1).cpu().tolist()
    out = []
    for row in gen:
        if tok.eos_token_id in row:
            row = row[:row.index(tok.eos_token_id)]
        out.append(tok.decode(row, skip_special_tokens=True).strip())
    return out


def _all_reduce_sum(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = t.to(device)
        dist.all_reduce(t)
    return t.cpu()


# --- entry point ---------------------------------------------------------------------------------

def build_data(cfg: DataConfig, *, seq_len: int, micro_batch: int, dp_rank: int, dp_world: int,
               seed: int, cache_dir: Path, vocab_size: int) -> DataModule:
    """Tokenize (or load from cache), pack, and return this rank's ``DataModule``."""
    cfg = _as_config(cfg)
    problems = cfg.problems()
    if problems:
        raise ValueError("invalid data config: " + "; ".join(problems))
    tok = build_tokenizer(cfg, Path(cache_dir))
    if len(tok) != vocab_size:
        raise ValueError(
            f"tokenizer {cfg.tokenizer or 'project (data.tokenizer=null)'} has {len(tok)} tokens "
            f"but model.vocab_size={vocab_size}; set model.vocab_size={len(tok)} or pick a "
            "tokenizer of the model's vocabulary (data.tokenizer)")
    prep = prepare_data(cfg, seq_len=seq_len, cache_dir=Path(cache_dir), tokenizer=tok,
                        show_progress=dp_rank == 0)
    pad = tok.pad_token_id
    train = Packed.build(TokenStore(prep.train), seq_len, pad, cfg.packing)
    ev = Packed.build(TokenStore(prep.eval), seq_len, pad, cfg.packing)
    stats = {
        "packing_efficiency": train.efficiency,
        "eval_packing_efficiency": ev.efficiency,
        "train_records": float(len(train.store)),
        "train_rows": float(len(train)),
        "train_tokens": float(train.store.lengths.sum()),
        "train_target_tokens": float(train.store.mask.sum()),
        "eval_records": float(len(ev.store)),
        "eval_rows": float(len(ev)),
        "records_truncated": float(prep.meta["train"]["truncated"] + prep.meta["eval"]["truncated"]),
        "records_dropped": float(prep.meta["train"]["dropped"] + prep.meta["eval"]["dropped"]),
        "tokenized_from_cache": float(prep.from_cache),
        "tokenizer_size": float(len(tok)),
    }
    log.info("data %s: %d train records in %d rows of %d (packing efficiency %.3f), %d eval rows",
             cfg.name, len(train.store), len(train), seq_len, train.efficiency, len(ev))
    return DataModule(train=train, eval=ev, tokenizer=tok, micro_batch=micro_batch, dp_rank=dp_rank,
                      dp_world=dp_world, seed=seed, stats=stats)
