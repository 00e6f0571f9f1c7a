"""Where records come from: local files (json/jsonl/parquet/csv/txt), a hub or local dataset
directory, or the synthetic task; and the held-out split."""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..config import DataConfig
from .synthetic import synthetic_records

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv",
                 ".txt": "text"}


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
        builder = FILE_BUILDERS[Path(f).suffix.lower()]
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
        files = sorted(str(f) for f in p.rglob("*") if f.suffix.lower() in FILE_BUILDERS)
    else:
        files = sorted(glob.glob(str(p))) if any(c in spec for c in "*?[") else [str(p)]
    if not files:
        raise FileNotFoundError(f"data.path={spec!r}: no data files there "
                                f"(looked for {', '.join(FILE_BUILDERS)})")
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"data.path={spec!r}: {f} does not exist")
        if Path(f).suffix.lower() not in FILE_BUILDERS:
            raise ValueError(f"{f}: unsupported file type; use one of {', '.join(FILE_BUILDERS)}")
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


def load_sources(cfg: DataConfig, cache_dir: Path) -> tuple[Split, Split]:
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

