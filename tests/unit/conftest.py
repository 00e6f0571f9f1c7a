"""Unit-test fixtures shared by several modules."""
from __future__ import annotations

from pathlib import Path

import pytest

from llama_fsdp.config.schema import DataConfig
from llama_fsdp.data import build_data


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The session's data cache (tokenizer and tokenized data are built once)."""
    return tmp_path_factory.getbasetemp() / "data-cache"


@pytest.fixture(scope="module")
def dm(cache):
    """A small synthetic data module on one rank: 300 records, 40 held out, rows of 128."""
    return build_data(DataConfig(num_records=300, eval_records=40), seq_len=128, micro_batch=4,
                      dp_rank=0, dp_world=1, seed=0, cache_dir=cache, vocab_size=512)
