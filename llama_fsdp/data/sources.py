"""Where records come from: local files (json/jsonl/parquet/csv/txt), a hub or local dataset
directory, or the synthetic task; the optional per-record hook (data.preprocess); and the
held-out split."""
from __future__ import annotations

import glob
import hashlib
import importlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from ..config.schema import DataConfig
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
    origin: str = ""  # how the split was made, for the log ("held out 5 of 102 records ...")


def _load_files(spec: str, cache_dir: Path) -> Split:
    """Local files through ``datasets.load_dataset(<builder>, data_files=...)``, one by one."""
    import datasets

    files = _resolve_files(spec)
    parts, loaded, start = [], [], 0
    for f in files:
        if os.path.getsize(f) == 0:
            raise ValueError(f"{f}: empty file (no records)")
        builder = FILE_BUILDERS[Path(f).suffix.lower()]
        if builder != "parquet" and (why := _not_text(f)):
            raise ValueError(why)
        if builder == "json" and (why := _too_deep(f)):
            raise ValueError(why)
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


# Deeper JSON than any record needs (a chat's messages are 3 levels): a parser that recurses
# per level crashes the process on a file nested 100,000 deep (pyarrow's: a segfault).
MAX_JSON_DEPTH = 100
_JSON_STRING = re.compile(rb'"[^"\\\n]*(?:\\.[^"\\\n]*)*"')  # a string, escapes and all
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def _too_deep(path: str) -> Optional[str]:
    """Where a .json / .jsonl file nests deeper than MAX_JSON_DEPTH, or None: read line by line
    before any parser sees it (a JSON string never spans lines; brackets inside one are not
    nesting)."""
    per_line = path.lower().endswith(".jsonl")
    depth = 0
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            for c in _JSON_STRING.sub(b"", line).translate(None, _NOT_BRACKETS):
                depth += 1 if c in b"[{" else -1
                if depth > MAX_JSON_DEPTH:
                    return (f"{path}: line {n}: JSON nested more than {MAX_JSON_DEPTH} levels "
                            "deep, which no record needs (and which crashes JSON parsers): "
                            "flatten the record, or remove it")
            if per_line:
                depth = 0
    return None


def _not_text(path: str, probe: int = 1 << 16) -> Optional[str]:
    """Why a .jsonl / .json / .csv / .txt file is not UTF-8 text (a NUL byte or bytes that do
    not decode, in its first 64 KiB), or None: a binary file is named as one, not reported as
    "malformed JSON line 1"."""
    with open(path, "rb") as fh:
        head = fh.read(probe)
    bad = [at] if (at := head.find(b"\0")) >= 0 else []
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3 or len(head) < probe:  # (not a character cut by the probe)
            bad.append(e.start)
    if not bad:
        return None
    at = min(bad)
    kind = ("gzip-compressed" if head[:2] == b"\x1f\x8b" else
            "a parquet file" if head[:4] == b"PAR1" else "binary")
    return (f"{path}: not a text file ({kind}: byte {at} is not UTF-8 text); "
            f"{Path(path).suffix} files are read as UTF-8 text: decompress it, give a parquet "
            "file its .parquet name, or point data.path at the text file")


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
    """(train, eval) records. Without an eval file / split, ``eval_count`` records are held out
    of the training records (after data.preprocess)."""
    import datasets

    match cfg.name:
        case "synthetic":
            n_eval = eval_count(cfg, cfg.num_records, generated=True)
            tr = datasets.Dataset.from_list(synthetic_records(cfg.num_records, cfg.seed, "train"))
            ev = datasets.Dataset.from_list(synthetic_records(n_eval, cfg.seed, "eval"))
            return (Split(tr, RecordLocator((("synthetic train", 0, len(tr)),)), "synthetic train",
                          f"{len(tr)} generated records"),
                    Split(ev, RecordLocator((("synthetic eval", 0, len(ev)),)), "synthetic eval",
                          f"{len(ev)} generated records by {_rule(cfg)}"))
        case "jsonl":
            train = preprocess(cfg, _load_files(cfg.path, cache_dir))
            if cfg.eval_path:
                ev = preprocess(cfg, _load_files(cfg.eval_path, cache_dir))
                ev.origin = f"data.eval_path={cfg.eval_path} ({len(ev.records)} records)"
                train.origin = f"{len(train.records)} records"
                return train, ev
        case "hf":
            train = preprocess(cfg, _load_hub(cfg, cfg.split, cache_dir))
            if cfg.eval_split:
                ev = preprocess(cfg, _load_hub(cfg, cfg.eval_split, cache_dir))
                ev.origin = f"data.eval_split={cfg.eval_split} ({len(ev.records)} records)"
                train.origin = f"{len(train.records)} records"
                return train, ev
        case _:
            raise ValueError(f"data.name={cfg.name!r}: valid: {', '.join(DataConfig.SOURCES)}")
    return _hold_out(train, cfg)


def eval_count(cfg: DataConfig, n: int, *, generated: bool = False, source: str = "") -> int:
    """Records held out for eval out of ``n``: data.eval_records if set; else eval_fraction of
    them, at least eval_min_records, at most eval_max_records, and (held out of a file) never so
    many that nothing trains."""
    where = f"{source}: " if source else ""
    if cfg.eval_records is not None:
        if not generated and cfg.eval_records >= n:
            raise ValueError(
                f"{where}data.eval_records={cfg.eval_records} leaves no training records ({n} "
                "records in total): lower it, set data.eval_records=null to hold out "
                "data.eval_fraction of them, or name an eval file / split (data.eval_path / "
                "data.eval_split)")
        return cfg.eval_records
    if cfg.eval_fraction <= 0 or cfg.eval_max_records == 0:
        return 0
    k = min(max(int(cfg.eval_fraction * n + 0.5), cfg.eval_min_records), cfg.eval_max_records)
    if generated:
        return k
    if n <= cfg.eval_min_records:
        raise ValueError(
            f"{where}{n} record(s) are too few to hold out data.eval_min_records="
            f"{cfg.eval_min_records} for eval and train on the rest: add records, name an eval "
            "file / split (data.eval_path / data.eval_split), or set data.eval_fraction=0 to "
            "train on all of them without eval")
    return min(k, n - 1)


def _rule(cfg: DataConfig) -> str:
    if cfg.eval_records is not None:
        return f"data.eval_records={cfg.eval_records}"
    return (f"data.eval_fraction={cfg.eval_fraction:g} (at least data.eval_min_records="
            f"{cfg.eval_min_records}, at most data.eval_max_records={cfg.eval_max_records})")


def _hold_out(train: Split, cfg: DataConfig) -> tuple[Split, Split]:
    n = len(train.records)
    n_eval = eval_count(cfg, n, source=train.name)
    perm = np.random.default_rng(cfg.seed).permutation(n)
    ev_idx, tr_idx = np.sort(perm[:n_eval]), np.sort(perm[n_eval:])
    origin = (f"held out {n_eval} of {n} records by {_rule(cfg)}" if n_eval
              else f"none held out of {n} records by {_rule(cfg)}")
    return (Split(train.records.select(tr_idx), _Remapped(train.where, tr_idx), train.name,
                  f"{len(tr_idx)} of {n} records"),
            Split(train.records.select(ev_idx), _Remapped(train.where, ev_idx),
                  f"{train.name} (held out)", origin))


class _Remapped:
    """A locator for a selection: position in the selection → original record."""

    def __init__(self, where: Callable[[int], str], idx: np.ndarray, suffix: str = ""):
        self.where, self.idx, self.suffix = where, idx, suffix

    def __call__(self, i: int) -> str:
        return self.where(int(self.idx[i])) + self.suffix


# --- data.preprocess ---------------------------------------------------------------------------

def preprocess(cfg: DataConfig, split: Split) -> Split:
    """``split`` through the data.preprocess hook (unchanged without one): each record becomes
    the hook's record, its list of records, or nothing (None). Errors name the source record."""
    if not cfg.preprocess:
        return split
    import datasets

    fn = load_hook(cfg.preprocess)
    rows: list[dict] = []
    src: list[int] = []
    index = 0
    for batch in split.records.iter(batch_size=1000):
        keys = list(batch)
        for j in range(len(batch[keys[0]]) if keys else 0):
            rec = {k: batch[k][j] for k in keys}
            try:
                out = fn(rec)
            except Exception as e:  # noqa: BLE001 - the user's code: name the record
                raise ValueError(f"{split.where(index)}: data.preprocess={cfg.preprocess} raised "
                                 f"{type(e).__name__}: {e}") from e
            if out is not None:
                many = [out] if isinstance(out, dict) else out
                if not isinstance(many, list) or not all(isinstance(r, dict) for r in many):
                    raise ValueError(
                        f"{split.where(index)}: data.preprocess={cfg.preprocess} returned "
                        f"{type(out).__name__}; it must return a record (dict), a list of "
                        "records, or None to skip the record")
                rows.extend(many)
                src.extend([index] * len(many))
            index += 1
    if not rows:
        raise ValueError(f"{split.name}: data.preprocess={cfg.preprocess} kept none of the "
                         f"{index} records")
    try:
        records = datasets.Dataset.from_list(rows)
    except Exception as e:  # noqa: BLE001 - e.g. one column with values of different types
        raise ValueError(f"{split.name}: the records data.preprocess={cfg.preprocess} returned do "
                         f"not form one table (each column needs one type): {e}") from e
    return Split(records, _Remapped(split.where, np.asarray(src), " (before data.preprocess)"),
                 split.name, split.origin)


def _hook_parts(spec: str) -> tuple[str, str, bool]:
    target, _, fn = spec.rpartition(":")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    return target, fn, is_file


def _hook_file(spec: str) -> Optional[str]:
    """The hook's source file, if it can be found (without importing the module itself)."""
    target, _, is_file = _hook_parts(spec)
    if is_file:
        path = Path(target).expanduser().resolve()
        return str(path) if path.is_file() else None
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return None
    origin = found.origin if found is not None else None
    return origin if origin and os.path.isfile(origin) else None


_HOOKS: dict[str, tuple[Optional[str], Callable[[dict], Any]]] = {}


def load_hook(spec: str) -> Callable[[dict], Any]:
    """The function data.preprocess names: "module:function" (importable here) or
    "path/to/file.py:function"; loaded again when its file changed."""
    stamp = hook_fingerprint(spec, load=False)
    hit = _HOOKS.get(spec)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    target, fn, is_file = _hook_parts(spec)
    if is_file:
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"data.preprocess={spec!r}: no file {path}")
        mod_spec = importlib.util.spec_from_file_location(
            f"_llama_fsdp_preprocess_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}", path)
        module = importlib.util.module_from_spec(mod_spec)  # type: ignore[arg-type]
        try:
            mod_spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"data.preprocess={spec!r}: {path} fails to import: "
                             f"{type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
            if hit is not None:  # imported before, and its file changed since
                module = importlib.reload(module)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"data.preprocess={spec!r}: cannot import {target!r} ({type(e).__name__}: "
                             f"{e}); put it on PYTHONPATH or name the file: "
                             "data.preprocess=path/to/file.py:function") from e
    f = getattr(module, fn, None)
    if not callable(f):
        raise ValueError(f"data.preprocess={spec!r}: {target} has no function {fn!r}")
    _HOOKS[spec] = (stamp, f)
    return f


def hook_fingerprint(spec: Optional[str], *, load: bool = True) -> Optional[str]:
    """A hash of the hook's source file (part of the data cache key: an edited hook tokenizes
    again). Only that file counts, not what it imports. ``load``: when the file cannot be found,
    raise the import error that says why."""
    if not spec:
        return None
    path = _hook_file(spec)
    if path is None:
        if load:
            load_hook(spec)  # raises the error that says why it cannot be found
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def source_stamp(cfg: DataConfig) -> list:
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
