"""Per-rank sampling: disjoint and covering shares, per-epoch order, exact resume, eval shares."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llama_fsdp.config.schema import DataConfig
from llama_fsdp.data import IGNORE_INDEX, build_data


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "data-cache"


def _dm(cache, *, rank=0, world=1, micro_batch=2, seed=0, **cfg):
    return build_data(DataConfig(num_records=300, eval_records=40, **cfg), seq_len=64,
                      micro_batch=micro_batch, dp_rank=rank, dp_world=world, seed=seed,
                      cache_dir=cache, vocab_size=512)


def _row_keys(batch):
    return [tuple(r.tolist()) for r in batch["input_ids"]]


def _epoch(dm):
    it = dm.train_batches()
    return [next(it) for _ in range(dm.batches_per_epoch)]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_take_disjoint_covering_shares(cache, world):
    mods = [_dm(cache, rank=r, world=world) for r in range(world)]
    n_rows = int(mods[0].stats["train_rows"])
    per_rank = [[k for b in _epoch(m) for k in _row_keys(b)] for m in mods]
    seen = [k for keys in per_rank for k in keys]
    assert len(seen) == len(set(seen))  # disjoint (packed rows are distinct)
    usable = (n_rows // (2 * world)) * 2 * world
    assert len(seen) == usable and n_rows - usable < 2 * world  # covering up to one global batch


@pytest.mark.parametrize("world", [2, 4])
def test_each_global_batch_is_split_across_ranks(cache, world):
    """Step by step, the ranks' micro-batches together are the rows one rank with the whole
    global batch (micro_batch x world) takes at that step: the same global order, sharded."""
    one = _epoch(_dm(cache, micro_batch=2 * world))
    ranks = [_epoch(_dm(cache, rank=r, world=world)) for r in range(world)]
    assert all(len(batches) == len(one) for batches in ranks)
    for step, whole in enumerate(one):
        split = sorted(k for batches in ranks for k in _row_keys(batches[step]))
        assert split == sorted(_row_keys(whole)), f"step {step}"


def test_new_epoch_reorders_reproducibly(cache):
    dm = _dm(cache)
    it = dm.train_batches()
    n = dm.batches_per_epoch
    e0 = [_row_keys(next(it)) for _ in range(n)]
    e1 = [_row_keys(next(it)) for _ in range(n)]
    assert dm.position["epoch"] == 1
    assert e0 != e1
    a, b = set(sum(e0, [])), set(sum(e1, []))  # each epoch skips a different tail (< 1 batch)
    assert len(a) == len(b) == n * 2 and len(a | b) <= dm.stats["train_rows"]
    again = _dm(cache)
    it2 = again.train_batches()
    assert [_row_keys(next(it2)) for _ in range(n)] == e0  # same seed, same order
    other = _dm(cache, seed=1)
    assert [_row_keys(next(other.train_batches()))] != e0[:1]


def test_state_dict_resumes_exactly(cache):
    dm = _dm(cache)
    it = dm.train_batches()
    for _ in range(dm.batches_per_epoch + 3):  # into the second epoch
        next(it)
    state = dm.state_dict()
    expected = [next(it) for _ in range(5)]
    resumed = _dm(cache)
    resumed.load_state_dict(state)
    it2 = resumed.train_batches()
    for want in expected:
        got = next(it2)
        assert all(torch.equal(want[k], got[k]) for k in want)
    assert state["epoch"] == 1 and state["index"] == 3 * 2


def test_state_for_other_data_starts_next_epoch(cache):
    dm = _dm(cache)
    dm.load_state_dict({"epoch": 2, "index": 8, "rows": 1})
    assert dm.position == {"epoch": 3, "index": 0}


@pytest.mark.parametrize("world", [1, 2])
def test_data_smaller_than_a_global_batch_repeats_every_row_equally(cache, world):
    from collections import Counter

    mods = [_dm(cache, rank=r, world=world, micro_batch=100) for r in range(world)]
    n_rows = len(mods[0].train)
    assert n_rows < 100 * world and mods[0].batches_per_epoch >= 1
    repeats = mods[0].repeats
    assert repeats == -(-100 * world // n_rows)
    # one epoch: every rank's batches together use each row `repeats` times, give or take the
    # tail that does not fill a global batch
    seen = Counter(k for m in mods for b in _epoch(m) for k in _row_keys(b))
    assert set(seen) == {k for i in range(n_rows) for k in _row_keys(mods[0].train.batch([i]))}
    assert max(seen.values()) <= repeats and sum(seen.values()) == \
        mods[0].batches_per_epoch * 100 * world


@pytest.mark.parametrize("world", [1, 2, 4])
def test_eval_batches_equal_count_and_cover_every_row_once(cache, world):
    mods = [_dm(cache, rank=r, world=world, micro_batch=3) for r in range(world)]
    per_rank = [m.eval_batches() for m in mods]
    assert len({len(b) for b in per_rank}) == 1  # lockstep for FSDP
    assert {tuple(x["input_ids"].shape) for b in per_rank for x in b} == {(3, 64)}
    labelled = [k for bs in per_rank for b in bs for k, lab in zip(_row_keys(b), b["labels"])
                if (lab != IGNORE_INDEX).any()]
    assert len(labelled) == len(set(labelled)) == mods[0].stats["eval_rows"]
    assert len(mods[0].eval_batches(1)) == 1
