"""The driver's check of data the cache already holds, without transformers or datasets.

The driver reads, checks, tokenizes and packs the data once (``build_data``, from prepare/data.py)
and then ``record``s what it found, under a key of everything the result depends on: the data
options, the run's shapes (seq_len, micro-batch, ranks, seed, vocabulary), the source files'
and the preprocess hook's stamps, and the data code itself. A later launch with the same inputs
``lookup``s that record instead: when the tokenizer directory it names is as it was (every
file's size and mtime) and the cached entry still matches its manifest (sizes and SHA-256, the
check the driver makes before ranks start), the driver prints the same notes and numbers from
it and loads nothing. The ranks load the cached entry as always. Only tokenizers in a local
directory (the project tokenizer, model.path's, a data.tokenizer directory) are recorded: a hub
name resolves to a snapshot the record cannot stamp.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..config.schema import DataConfig
from ..config.manifest import cached_entry_ok
from ..config.rundir import replace_text
from .report import DataInfo, ready_line
from .sources import hook_fingerprint, source_stamp

log = logging.getLogger("llama_fsdp.data")

WARM = "warm"  # cache_dir/data/warm/<key>.json
VERSION = 1  # of the record's layout


@dataclass
class WarmData:
    """What the driver needs of prepared data, read from a record: the numbers a DataModule
    reports (``stats``, rows, micro-batches per epoch) and its ``info`` with the notes."""

    stats: dict[str, float]
    info: DataInfo
    train_rows: int
    eval_rows: int
    batches_per_epoch: int
    summary: str  # the line build_data logs last

    def announce(self) -> None:
        log.info("tokenized data found in cache: %s", self.info.cache_path)
        self.info.announce(log)
        log.info("%s", self.summary)


def _code_stamp() -> str:
    """The data package's own source: a change to how data is read, tokenized or packed makes
    every record stale."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()


def _dir_stamp(path: Path) -> list:
    """Name, size and mtime of every file directly in ``path``."""
    return sorted([f.name, st.st_size, st.st_mtime_ns] for f in path.iterdir()
                  if f.is_file() and (st := f.stat()))


def _file_stamp(text: Optional[str]) -> Optional[list]:
    """A value that names a file (data.chat_template may): its size and mtime too."""
    if not text or "\n" in text or not Path(text).expanduser().is_file():
        return None
    st = Path(text).expanduser().stat()
    return [st.st_size, st.st_mtime_ns]


def _key(cfg: DataConfig, shapes: dict[str, Any]) -> str:
    blob = {"v": VERSION, "code": _code_stamp(), "cfg": dataclasses.asdict(cfg),
            "shapes": shapes, "files": source_stamp(cfg),
            "hook": hook_fingerprint(cfg.preprocess, load=False),
            "chat_template": _file_stamp(cfg.chat_template)}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def _path(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / "data" / WARM / f"{key[:32]}.json"


def lookup(cfg: DataConfig, *, cache_dir: Path, **shapes: Any) -> Optional[WarmData]:
    """The record of data prepared with exactly these inputs, if its tokenizer and cached entry
    are as they were; else None (the caller builds the data, and records it)."""
    try:
        rec = json.loads(_path(cache_dir, _key(cfg, shapes)).read_text())
        tokenizer = Path(rec["tokenizer_dir"])
        if _dir_stamp(tokenizer) != rec["tokenizer_stamp"]:
            return None
    except (OSError, ValueError, KeyError):
        return None
    info = DataInfo(**{**rec["info"], "notes": tuple(tuple(n) for n in rec["info"]["notes"])})
    if not cached_entry_ok(Path(info.cache_path), digests=True):
        return None  # build_data names what is wrong and builds it again
    return WarmData(stats={**rec["stats"], "tokenized_from_cache": 1.0}, info=info, train_rows=rec["train_rows"],
                    eval_rows=rec["eval_rows"], batches_per_epoch=rec["batches_per_epoch"],
                    summary=rec["summary"])


def record(cfg: DataConfig, data: Any, *, cache_dir: Path, **shapes: Any) -> None:
    """Keep what the driver found of ``data`` (a DataModule it built with these inputs) for the
    next ``lookup``; nothing for a tokenizer outside a local directory."""
    tokenizer = Path(data.info.tokenizer)
    if not tokenizer.is_dir():
        return
    train, eval_ = data.train, data.eval
    summary = ready_line(train_rows=len(train), seq_len=shapes["seq_len"],
                         efficiency=train.efficiency, eval_rows=len(eval_),
                         cache_path=data.info.cache_path)
    rec = {"tokenizer_dir": str(tokenizer), "tokenizer_stamp": _dir_stamp(tokenizer),
           "stats": data.stats, "info": dataclasses.asdict(data.info),
           "train_rows": len(train), "eval_rows": len(eval_),
           "batches_per_epoch": data.batches_per_epoch, "summary": summary}
    path = _path(cache_dir, _key(cfg, shapes))
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_text(path, json.dumps(rec, indent=1))
