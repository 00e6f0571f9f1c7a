"""Tokenize both splits once into the cache (rank-safe), or find them there."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol

import numpy as np

from ..config.schema import DataConfig
from ..config.manifest import cached_entry_ok, write_manifest
from .formats import Encoder, detect_format
from .packing import record_lengths
from .sources import Split, hook_fingerprint, load_sources, source_stamp
from .synthetic import synthetic_corpus
from .tokenizer import (
    TokenizerChoice,
    choose_tokenizer,
    load_tokenizer,
    set_chat_template,
    tokenizer_fingerprint,
)

log = logging.getLogger(__name__)

# Bump when tokenization or the cached layout changes: it is part of the cache key.
# 2: chat records tokenized whole (as apply_chat_template), eval hold-out by fraction, length /
#    character statistics in meta.json, records without targets left out.
# 3: a manifest (every file's size and SHA-256) marks a complete entry.
_CACHE_VERSION = 3
# Columns the encoder adds for statistics and filtering; not stored.
_WORK_COLUMNS = ("full_len", "targets", "chars", "keep")


class RecordKind(Protocol):
    """Records other than the SFT formats (preference pairs: data/preference.py): where they
    come from, how a split is tokenized, and what of theirs keys the cache."""

    name: str  # in the cache entry's name

    def fingerprint(self, cfg: DataConfig) -> Any: ...

    def load(self, cfg: DataConfig, cache_dir: Path) -> tuple[Split, Split]: ...

    def tokenize(self, cfg: DataConfig, split: Split, tok, seq_len: int, split_name: str,
                 key: str) -> tuple[Any, dict]: ...


@dataclass
class Tokenized:
    """Tokenized train / eval splits (Arrow tables, memory-mapped) and what building them
    found."""

    train: Any
    eval: Any
    meta: dict[str, Any]
    from_cache: bool
    path: Path


def tokenize_splits(cfg: DataConfig, *, seq_len: int, cache_dir: Path, tokenizer=None,
                    model_path: Optional[str] = None, show_progress: bool = True,
                    verify_digests: bool = False, kind: Optional[RecordKind] = None) -> Tokenized:
    """Tokenize both splits into ``cache_dir/data/<key>`` or find them there.

    ``tokenizer``: the one to use (default: ``resolve_tokenizer`` with ``model_path``).
    Rank-safe: the first process to take the lock builds into a temporary directory, writes
    its manifest and renames it into place; the others wait for the lock and load the result.
    An entry whose files do not match their manifest (sizes; with ``verify_digests``, as the
    driver checks before the ranks start, SHA-256 too) is rebuilt, with a warning naming the
    file. ``kind``: records other than the SFT formats (preference pairs), keyed apart.
    """
    cfg, cache_dir = as_config(cfg), Path(cache_dir)
    tok = tokenizer if tokenizer is not None else build_tokenizer(cfg, cache_dir,
                                                                  model_path=model_path)
    key = _cache_key(cfg, seq_len, tok, kind)
    root = cache_dir / "data"
    final = root / f"{cfg.name}-{kind.name + '-' if kind else ''}{key[:20]}"
    if not cached_entry_ok(final, digests=verify_digests):
        from filelock import FileLock

        root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(root / f"{final.name}.lock")):
            if not cached_entry_ok(final, digests=verify_digests, damaged=(
                    "the cached tokenized data is damaged ({problem}): tokenizing again")):
                _build(cfg, seq_len, tok, cache_dir, final, show_progress, kind)
                return _load_tokenized(final, from_cache=False)
    log.info("tokenized data found in cache: %s", final)
    return _load_tokenized(final, from_cache=True)


def resolve_tokenizer(cfg: DataConfig, cache_dir: Path, *,
                      model_path: Optional[str] = None) -> tuple[Any, TokenizerChoice]:
    """The tokenizer the data is encoded with, and why it was chosen: data.tokenizer, else
    model.path's own, else the project tokenizer (trained on the synthetic corpus); with
    data.chat_template applied."""
    choice = choose_tokenizer(cfg.tokenizer, model_path)
    tok = load_tokenizer(choice.name_or_path, cache_dir=Path(cache_dir), corpus=synthetic_corpus,
                         source=choice.source)
    set_chat_template(tok, cfg.chat_template)
    return tok, choice


def build_tokenizer(cfg: DataConfig, cache_dir: Path, *, model_path: Optional[str] = None):
    """The tokenizer of ``resolve_tokenizer``."""
    return resolve_tokenizer(cfg, cache_dir, model_path=model_path)[0]


def as_config(cfg) -> DataConfig:
    """A DataConfig from a composed DictConfig node too (the worker may pass either)."""
    if isinstance(cfg, DataConfig):
        return cfg
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), cfg))


def _cache_key(cfg: DataConfig, seq_len: int, tok, kind: Optional[RecordKind] = None) -> str:
    fields = {f: getattr(cfg, f) for f in (
        "name", "num_records", "eval_fraction", "eval_min_records", "eval_max_records",
        "eval_records", "seed", "path", "subset", "revision", "split", "eval_split", "eval_path",
        "preprocess", "format", "instruction_column", "input_column", "output_column",
        "messages_column", "text_column", "prompt_template", "prompt_template_no_input",
        "train_on_prompt", "overlong")}
    if cfg.name != "synthetic":  # generation options do not apply to files / hub data
        fields.pop("num_records")
    fields["preprocess_source"] = hook_fingerprint(cfg.preprocess)
    blob = {"v": _CACHE_VERSION, "cfg": fields, "seq_len": seq_len,
            "tokenizer": tokenizer_fingerprint(tok), "files": source_stamp(cfg),
            **({"kind": [kind.name, kind.fingerprint(cfg)]} if kind else {})}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def _build(cfg: DataConfig, seq_len: int, tok, cache_dir: Path, final: Path,
           show_progress: bool, kind: Optional[RecordKind] = None) -> None:
    import datasets

    meta: dict[str, Any] = {"name": cfg.name, "seq_len": seq_len, "tokenizer": tok.name_or_path}
    for stale in final.parent.glob(f".{final.name}-*"):  # builds killed midway (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    was_enabled = datasets.is_progress_bar_enabled()
    if not show_progress:
        datasets.disable_progress_bars()
    try:
        train, ev = (kind.load if kind else load_sources)(cfg, cache_dir)
        tokenize = kind.tokenize if kind else _tokenize
        for split_name, split in (("train", train), ("eval", ev)):
            ds, info = tokenize(cfg, split, tok, seq_len, split_name, final.name)
            if len(ds):  # (datasets cannot reload an empty saved dataset: absent means empty)
                datasets.disable_progress_bars()  # a local copy: nothing to watch
                ds.save_to_disk(str(tmp / split_name))
                if show_progress and was_enabled:
                    datasets.enable_progress_bars()
            meta[split_name] = info
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        write_manifest(tmp, digests=True)  # last: it marks the entry complete
        shutil.rmtree(final, ignore_errors=True)  # an incomplete one (no manifest)
        os.replace(tmp, final)
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _spawned_workers(active: bool) -> Iterator[None]:
    """datasets' ``map(num_proc=N)`` pool, started with spawn instead of Linux's fork while
    the block runs. A forked worker inherits the parent's threads' locks, its pipes and its
    Python signal handlers: from a process with threads (the driver's MLflow and progress
    threads, a test worker's servers) a worker could hang in a lock held at fork time, and
    ``Pool.terminate`` after a bad record then waited for it forever. Spawned workers start
    clean (a second or two to import, once per map)."""
    if not active:
        yield
        return
    import multiprocess

    previous = multiprocess.get_start_method(allow_none=True)
    multiprocess.set_start_method("spawn", force=True)
    try:
        yield
    finally:
        multiprocess.set_start_method(previous, force=True)


def _tokenize(cfg: DataConfig, split: Split, tok, seq_len: int, split_name: str,
              key: str) -> tuple[Any, dict]:
    """Encode every record; leave out records dropped as overlong and records without any target
    token; return the stored rows and what was found (counts, lengths, characters)."""
    records = split.records
    if len(records) == 0:
        return _empty_tokenized(), split_info(split, None, np.zeros(0, np.int64),
                                              np.zeros(0, bool), np.zeros(0, np.int64),
                                              np.zeros(0, bool), 0, 0)
    fmt, fcfg = detect_format(cfg, records.features, split.name)
    encoder = Encoder(tok, fmt, fcfg, seq_len, split.where)
    log.info("tokenizing %d %s records (%s format, num_proc=%d)", len(records), split_name, fmt,
             cfg.num_proc)
    with _spawned_workers(cfg.num_proc > 1):
        ds = records.map(encoder, batched=True, with_indices=True,
                         remove_columns=records.column_names,
                         num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
                         features=_work_features(), desc=f"tokenizing {split_name}",
                         load_from_cache_file=False, new_fingerprint=f"{key[:32]}-{split_name}")
    table = ds.data.table if hasattr(ds.data, "table") else ds.data

    def col(name: str) -> np.ndarray:
        return table.column(name).to_numpy(zero_copy_only=False)

    full_len, keep, targets = col("full_len"), col("keep").astype(bool), col("targets")
    truncated = col("truncated").astype(bool)
    stored = keep & (targets > 0)
    chars = int(col("chars").sum())
    tokens = int(record_lengths(ds)[stored].sum())
    ds = ds.remove_columns(list(_WORK_COLUMNS))
    if not stored.all():
        ds = ds.select(np.nonzero(stored)[0])
    info = split_info(split, fmt, full_len, truncated, targets, keep, chars, tokens)
    if split_name == "train" and not len(ds):
        raise ValueError(f"{split.name}: none of the {len(records)} records can train: "
                         + no_training_reason(info, seq_len, cfg.overlong))
    return ds, info


def split_info(split: Split, fmt: Optional[str], full_len: np.ndarray, truncated: np.ndarray,
               targets: np.ndarray, keep: np.ndarray, chars: int, tokens: int) -> dict[str, Any]:
    """What tokenizing one split found (meta.json; the data module's notes read it)."""
    no_target = keep & (targets == 0)
    q = (np.percentile(full_len, [50, 90, 95, 99]).round().astype(int).tolist() if len(full_len)
         else [0, 0, 0, 0])
    return {"records_in": int(len(full_len)), "records": int((keep & (targets > 0)).sum()),
            "format": fmt, "origin": split.origin,
            "truncated": int(truncated.sum()), "dropped": int((~keep).sum()),
            "no_target": int(no_target.sum()),
            "no_target_truncated": int((no_target & truncated).sum()),
            "tokens": tokens, "full_tokens": int(full_len.sum()), "chars": chars,
            "length": {"p50": q[0], "p90": q[1], "p95": q[2], "p99": q[3],
                       "max": int(full_len.max()) if len(full_len) else 0},
            "seq_len_for_95": seq_len_covering(full_len, 0.95)}


def seq_len_covering(lengths: np.ndarray, share: float, multiple: int = 64) -> int:
    """The smallest multiple of ``multiple`` tokens that keeps ``share`` of the records whole."""
    if not len(lengths):
        return 0
    k = int(np.sort(lengths)[max(0, int(np.ceil(share * len(lengths))) - 1)])
    return -(-k // multiple) * multiple


def no_training_reason(info: dict[str, Any], seq_len: int, overlong: str) -> str:
    parts = []
    if info["dropped"]:
        parts.append(f"{info['dropped']} are longer than train.seq_len={seq_len} and were dropped "
                     f"(data.overlong={overlong})")
    if info["no_target"]:
        parts.append(f"{info['no_target']} have no target token"
                     + (f" ({info['no_target_truncated']} because truncation to train.seq_len="
                        f"{seq_len} cut off the answer)" if info["no_target_truncated"] else ""))
    lengths = info["length"]
    return ("; ".join(parts) + f". Record lengths in tokens: p50 {lengths['p50']}, p95 "
            f"{lengths['p95']}, max {lengths['max']}. Fix: raise train.seq_len (train.seq_len="
            f"{info['seq_len_for_95']} keeps 95% of the records whole)"
            + (", or set data.train_on_prompt=true" if info["no_target"] else ""))


def _tokenized_features():
    from datasets import Features, Sequence, Value

    return Features({"input_ids": Sequence(Value("int32")), "loss_mask": Sequence(Value("int8")),
                     "prompt_len": Value("int32"), "truncated": Value("bool"),
                     "task": Value("string")})


def _work_features():
    from datasets import Features, Value

    return Features({**_tokenized_features(), "full_len": Value("int32"),
                     "targets": Value("int32"), "chars": Value("int64"), "keep": Value("bool")})


def _empty_tokenized():
    import datasets

    return datasets.Dataset.from_dict({k: [] for k in _tokenized_features()},
                                      features=_tokenized_features())


def _load_tokenized(path: Path, *, from_cache: bool) -> Tokenized:
    meta = json.loads((path / "meta.json").read_text())
    train, ev = ((read_split(path / s) if (path / s).exists() else _empty_tokenized().data.table)
                 for s in ("train", "eval"))
    return Tokenized(train=train, eval=ev, meta=meta, from_cache=from_cache, path=path)


def read_split(path: Path):
    """A split that datasets' ``save_to_disk`` wrote, as one memory-mapped Arrow table: the
    files its state.json lists, in order, each an Arrow stream (what ``load_from_disk`` maps;
    save_to_disk flattens any indices first). Without the datasets package, which costs every
    rank 0.5 s of imports (pandas with it) for a table TokenStore reads as Arrow anyway."""
    import pyarrow as pa

    files = json.loads((path / "state.json").read_text())["_data_files"]
    tables = [pa.ipc.open_stream(pa.memory_map(str(path / f["filename"]))).read_all()
              for f in files]
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)

