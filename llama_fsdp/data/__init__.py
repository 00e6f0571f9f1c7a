"""Data: records → tokens with a loss mask → packed rows → per-rank micro-batches.

The worker's interface:

- ``build_data(cfg, *, seq_len, micro_batch, dp_rank, dp_world, seed, cache_dir, vocab_size,
  model_path=None, announce=None)`` returns a ``DataModule``; the driver calls it once
  (llama_fsdp/prepare/job.py, which reads, checks and tokenizes everything before any rank starts)
  and every rank calls it again, finding the tokenized data in the cache. Tokenized data is
  cached under ``cache_dir/data`` (keyed by source, tokenizer, seq_len and format options) and
  built by one process under a file lock with an atomic rename, so concurrent ranks are safe.
- The tokenizer: ``data.tokenizer``, else ``model_path``'s own (the model being fine-tuned),
  else the project tokenizer (tokenizer.py). One whose ids do not fit ``vocab_size`` is refused.
- ``DataModule.train_batches()`` yields this rank's micro-batches forever: ``input_ids``,
  ``labels`` (already shifted: ``labels[:, t]`` is the target of position t, ``IGNORE_INDEX``
  where no loss is taken) and ``position_ids`` (restarting at every packed record). Every key
  except ``labels`` goes to the model. Packed records do not attend to each other: the varlen
  kernel (llama_fsdp/model/attention.py) reads each record's bounds from the restarting position ids;
  with ``sdpa``, transformers derives a dense block-causal mask from them instead.
- ``DataModule.eval_batches(max_batches)``, ``state_dict()`` / ``load_state_dict()``,
  ``stats`` (numbers, for metrics), ``info`` (a ``DataInfo``: the tokenizer used and why, the
  split, the notes printed; ``info.params()`` for MLflow params) and ``tokenizer``; the task
  metric on held-out prompts is llama_fsdp/objective/sft.py's ``exact_match``.
"""
from __future__ import annotations

from ..lazy import lazy_names

# The package's names are imported on first use (PEP 562): the driver's check of data the cache
# already holds (check_record.py) loads neither transformers nor datasets.
_WHERE = {
    "build_data": "build",
    "Tokenized": "cache", "as_config": "cache", "build_tokenizer": "cache",
    "resolve_tokenizer": "cache", "tokenize_splits": "cache",
    "IGNORE_INDEX": "packing", "Packed": "packing", "TokenStore": "packing", "pack": "packing",
    "DataInfo": "report", "data_notes": "report", "describe_source": "report",
    "tokenizer_override_note": "report",
    "DataModule": "module",
    "SYNTHETIC_TASKS": "synthetic", "synthetic_corpus": "synthetic",
    "synthetic_records": "synthetic",
    "token_id_bound": "tokenizer", "vocab_problem": "tokenizer",
}
__all__ = sorted(_WHERE)


__getattr__ = lazy_names(__name__, _WHERE, globals())
