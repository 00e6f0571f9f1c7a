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

import logging
from pathlib import Path

from ..config import DataConfig
from .cache import Prepared, as_config, build_tokenizer, prepare_data
from .packing import IGNORE_INDEX, Packed, TokenStore, pack
from .sampler import DataModule
from .synthetic import SYNTHETIC_TASKS, synthetic_corpus, synthetic_records

log = logging.getLogger(__name__)

__all__ = ["DataModule", "IGNORE_INDEX", "Packed", "Prepared", "SYNTHETIC_TASKS", "TokenStore",
           "build_data", "build_tokenizer", "pack", "prepare_data", "synthetic_corpus",
           "synthetic_records"]


def build_data(cfg: DataConfig, *, seq_len: int, micro_batch: int, dp_rank: int, dp_world: int,
               seed: int, cache_dir: Path, vocab_size: int) -> DataModule:
    """Tokenize (or load from cache), pack, and return this rank's ``DataModule``."""
    cfg = as_config(cfg)
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
