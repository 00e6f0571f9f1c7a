"""``build_data``: records -> tokens (cached) -> packed rows -> this rank's DataModule (the data
package's docstring says what each part does)."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Optional

import numpy as np

from ..config.schema import DataConfig
from .cache import as_config, resolve_tokenizer, tokenize_splits
from .module import DataModule
from .packing import Packed, TokenStore
from .report import DataInfo, data_notes, describe_source, ready_line, tokenizer_override_note
from .tokenizer import token_id_bound, vocab_problem

log = logging.getLogger("llama_fsdp.data")


def short_answer_stats(store: TokenStore) -> dict[str, float]:
    """What exact match would decode on the held-out records (EvalConfig.SHORT_ANSWER_TOKENS):
    how many have an intact answer that short, the longest such answer and the longest prompt
    (the plan's eval cost reads them: plan/eval_cost.py)."""
    from ..config.schema import EvalConfig

    lengths = store.lengths
    answer = lengths - store.prompt_len
    short = (store.prompt_len > 0) & ~store.truncated.astype(bool) \
        & (answer <= EvalConfig.SHORT_ANSWER_TOKENS)
    return {"eval_short_answers": float(short.sum()),
            "eval_short_answer_tokens_max": float(answer[short].max()) if short.any() else 0.0,
            "eval_prompt_tokens_max": float(store.prompt_len[short].max()) if short.any()
            else 0.0}


def build_data(cfg: DataConfig, *, seq_len: int, micro_batch: int, dp_rank: int, dp_world: int,
               seed: int, cache_dir: Path, vocab_size: int, model_path: Optional[str] = None,
               announce: Optional[bool] = None, preference: bool = False) -> DataModule:
    """Tokenize (or load from cache), pack, and return this rank's ``DataModule``.

    ``model_path``: the HF model directory being fine-tuned (model.path): its tokenizer encodes
    the data unless data.tokenizer is set. ``announce``: log the data's notes (the split, the
    tokenizer used, advice); default: on dp rank 0. The driver announces; ranks need not again.
    ``preference``: prompt / chosen / rejected pairs (objective=dpo: data/preference.py), each
    pair's two sequences in one row.
    """
    from .preference import PAIRS, PairPacked

    cfg = as_config(cfg)  # (checked with the run: run/checks.py)
    announce = dp_rank == 0 if announce is None else announce
    tok, choice = resolve_tokenizer(cfg, Path(cache_dir), model_path=model_path)
    problem = vocab_problem(tok, choice, vocab_size)
    if problem:
        raise ValueError(problem)
    # the announcing process (the driver) checks the cache's digests before any rank reads it
    prep = tokenize_splits(cfg, seq_len=seq_len, cache_dir=Path(cache_dir), tokenizer=tok,
                           show_progress=dp_rank == 0, verify_digests=announce,
                           kind=PAIRS if preference else None)
    pad = tok.pad_token_id
    rows = PairPacked.build_pairs if preference else Packed.build
    train = rows(TokenStore(prep.train), seq_len, pad, cfg.packing)
    ev = rows(TokenStore(prep.eval), seq_len, pad, cfg.packing)
    tr_meta, ev_meta = prep.meta["train"], prep.meta["eval"]
    chars = tr_meta["chars"] + ev_meta["chars"]
    tokens_per_char = (tr_meta["full_tokens"] + ev_meta["full_tokens"]) / max(1, chars)
    size = token_id_bound(tok)
    per_row = np.diff(train.row_ptr)
    stats = {
        "packing_efficiency": train.efficiency,
        "eval_packing_efficiency": ev.efficiency,
        "train_records": float(len(train.store)),
        "train_rows": float(len(train)),
        # the most records one row holds (a DPO row: two per pair), and a micro-batch of the
        # fullest rows (padding joins its row's last record: attention.document_bounds): CUDA's
        # flash varlen backward allocates per record of a micro-batch
        # (plan/activations.py: varlen_backward_bytes)
        "records_per_row_max": float(per_row.max()) if len(per_row) else 0.0,
        "records_per_micro_batch_max": float(np.sort(per_row)[-micro_batch:].sum()),
        "train_tokens": float(train.store.lengths.sum()),
        "train_target_tokens": float(train.store.mask.sum()),
        "eval_records": float(len(ev.store)),
        "eval_rows": float(len(ev)),
        **({} if preference else short_answer_stats(ev.store)),
        "records_truncated": float(tr_meta["truncated"] + ev_meta["truncated"]),
        "records_dropped": float(tr_meta["dropped"] + ev_meta["dropped"]),
        "records_without_targets": float(tr_meta["no_target"] + ev_meta["no_target"]),
        "record_tokens_p50": float(tr_meta["length"]["p50"]),
        "record_tokens_p95": float(tr_meta["length"]["p95"]),
        "tokens_per_char": float(tokens_per_char),
        "tokenized_from_cache": float(prep.from_cache),
        "tokenizer_size": float(size),
        **({"train_pairs": float(train.pairs), "eval_pairs": float(ev.pairs)} if preference
           else {}),
    }
    info = DataInfo(
        source=describe_source(cfg), format=tr_meta["format"],
        tokenizer=(str(choice.name_or_path) if not choice.is_project
                   else str(Path(tok.name_or_path).resolve())),
        tokenizer_source=choice.source, tokenizer_size=size,
        train_records=len(train.store) // (2 if preference else 1),
        eval_records=len(ev.store) // (2 if preference else 1),
        train_origin=tr_meta["origin"], eval_origin=ev_meta["origin"],
        tokens_per_char=float(tokens_per_char), cache_path=str(prep.path))
    dm = DataModule(train=train, eval=ev, tokenizer=tok, micro_batch=micro_batch, dp_rank=dp_rank,
                    dp_world=dp_world, seed=seed, stats=stats, info=info)
    notes = data_notes(cfg, prep.meta, info, seq_len=seq_len, vocab_size=vocab_size,
                       repeats=dm.repeats, rows=len(train), global_batch=micro_batch * dp_world)
    if announce:
        override = tokenizer_override_note(choice, tok, model_path)
        if override:
            notes.append(override)
    dm.info = info = dataclasses.replace(info, notes=tuple(notes))
    if announce:
        info.announce(log)
        log.info("%s", ready_line(train_rows=len(train), seq_len=seq_len,
                                  efficiency=train.efficiency, eval_rows=len(ev),
                                  cache_path=str(prep.path)))
    return dm

