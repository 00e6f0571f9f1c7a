"""The data, read, checked, tokenized into the cache and packed once, here, as rank 0 will,
or known from the record of an earlier check (data/check_record.py); and the splits as MLflow
dataset inputs."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from ..data import check_record as warm
from ..run.spec import RunSpec
from .errors import PrepareError

log = logging.getLogger(__name__)


def check_data(spec: RunSpec) -> Any:
    """Read, validate, tokenize (into the cache) and pack the data as rank 0 will, once, here.

    Everything about the data that can be wrong fails now, in seconds, naming the file, the
    record and the fix: files and globs, formats and columns (layouts that cannot be mapped),
    too few records for the train / eval split, records without any target token, a tokenizer
    whose ids do not fit model.vocab_size, a model directory without its tokenizer. The tokenizer
    is model.path's own unless data.tokenizer is set (spec.model.path is a local directory by
    now: ``resolve_model`` ran first). The notes about the data (split, tokenizer, advice) are
    printed here, once; the ranks then find the tokenized data in the cache.
    """
    from ..data import build_data

    t0 = time.perf_counter()
    try:
        data = build_data(spec.data, **spec.data_kwargs(dp_rank=0, announce=True))
    except (ValueError, FileNotFoundError, OSError) as e:
        raise PrepareError(f"data: {e}") from e
    _log_ready(time.perf_counter() - t0, len(data.train), data.batches_per_epoch,
               len(data.eval), data.info)
    return data


def prepare_data(spec: RunSpec) -> Any:
    """``check_data``, or for inputs checked before, the record of that check (data/warm.py):
    the same notes and numbers, without loading transformers, datasets or the data here."""
    t0 = time.perf_counter()
    kwargs = spec.data_kwargs(dp_rank=0, announce=True)
    cache_dir = kwargs.pop("cache_dir")
    known = warm.lookup(spec.data, cache_dir=cache_dir, **kwargs)
    if known is None:
        data = check_data(spec)
        try:
            warm.record(spec.data, data, cache_dir=cache_dir, **kwargs)
        except OSError as e:  # a read-only cache: the next launch checks the data again
            log.debug("no record of the data's check: %s", e)
        return data
    known.announce()
    _log_ready(time.perf_counter() - t0, known.train_rows, known.batches_per_epoch,
               known.eval_rows, known.info)
    return known


def _log_ready(seconds: float, train_rows: int, batches: int, eval_rows: int, info: Any) -> None:
    log.info("data ready in %.1fs: %d training rows (%d micro-batches per rank per epoch), %d "
             "held-out rows; tokenizer %s (%s)", seconds, train_rows, batches, eval_rows,
             info.tokenizer, info.tokenizer_source)


def dataset_inputs(spec: RunSpec, data: Any) -> list[dict[str, Any]]:
    """The train and eval splits as MLflow dataset inputs: name, digest (the tokenized cache's
    key: source files, options and tokenizer), source, columns and size, so runs on different
    data differ visibly in the runs table."""
    cfg, info, stats = spec.data, data.info, data.stats
    match cfg.name:
        case "synthetic":
            kind, source = "code", {"generator": "llama_fsdp.data.synthetic", "seed": cfg.seed}
        case "hf":
            kind = "hugging_face"
            source = {"path": cfg.path, "config_name": cfg.subset, "split": cfg.split,
                      "revision": cfg.revision}
        case _:
            kind, source = "local", {"uri": str(Path(cfg.path).expanduser().resolve())}
    digest = Path(info.cache_path).name.rsplit("-", 1)[-1][:16]
    name = "synthetic" if cfg.name == "synthetic" else Path(str(cfg.path)).stem
    columns = {"mlflow_colspec": [{"type": "long", "name": "input_ids", "required": True},
                                  {"type": "long", "name": "labels", "required": True}]}
    out = []
    for split, context, records, extra in (
            ("train", "training", info.train_records, {"tokens": stats["train_tokens"],
                                                       "rows": stats["train_rows"]}),
            ("eval", "evaluation", info.eval_records, {"rows": stats["eval_rows"]})):
        profile = {"num_rows": records, "format": info.format, "tokenizer": info.tokenizer,
                   "seq_len": spec.train.seq_len, **extra}
        out.append({"name": f"{name}-{split}", "digest": digest, "source_type": kind,
                    "source": json.dumps({**source, "split": split} if kind == "code" else source),
                    "schema": json.dumps(columns), "profile": json.dumps(profile),
                    "context": context})
    return out

