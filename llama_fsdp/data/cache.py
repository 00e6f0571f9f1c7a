"""Tokenize both splits once into the cache (rank-safe), or find them there."""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import DataConfig
from .formats import Encoder, detect_format
from .packing import record_lengths
from .sources import Split, load_sources
from .synthetic import synthetic_corpus, synthetic_records
from .tokenizer import load_tokenizer, tokenizer_fingerprint

log = logging.getLogger(__name__)

# Bump when tokenization or the cached layout changes: it is part of the cache key.
_CACHE_VERSION = 1


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
    cfg, cache_dir = as_config(cfg), Path(cache_dir)
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


def as_config(cfg) -> DataConfig:
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
        train, ev = load_sources(cfg, cache_dir)
        for split_name, split in (("train", train), ("eval", ev)):
            ds, info = _tokenize(cfg, split, tok, seq_len, split_name, final.name)
            if len(ds):  # (datasets cannot reload an empty saved dataset: absent means empty)
                datasets.disable_progress_bars()  # a local copy: nothing to watch
                ds.save_to_disk(str(tmp / split_name))
                if show_progress and was_enabled:
                    datasets.enable_progress_bars()
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
    lengths = record_lengths(ds)
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

