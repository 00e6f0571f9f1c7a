"""Tokenized records as flat arrays, packed into rows of train.seq_len tokens."""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

IGNORE_INDEX = -100


class TokenStore:
    """A tokenized split as flat arrays: record i is ``ids[offsets[i]:offsets[i+1]]``."""

    def __init__(self, ds):
        """``ds``: a pyarrow Table (cache.read_split) or a datasets.Dataset."""
        self._table = table = _arrow(ds)
        ids = table.column("input_ids").combine_chunks()
        mask = table.column("loss_mask").combine_chunks()
        self.offsets = as_numpy(ids.offsets).astype(np.int64)
        self.ids = as_numpy(ids.values)
        self.mask = as_numpy(mask.values)
        self.prompt_len = as_numpy(table.column("prompt_len").combine_chunks())
        self.truncated = as_numpy(table.column("truncated").combine_chunks())

    def task(self, i: int) -> str:
        """The record's task kind ("" if the source has no ``task`` column)."""
        return self._table.column("task")[i].as_py()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def record(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.mask[a:b]


def as_numpy(arr) -> np.ndarray:
    """An integer or boolean Arrow array without nulls as numpy, read from its data buffer
    (zero-copy, but for booleans' bits): pyarrow's own to_numpy imports pandas, 0.3 s of every
    rank's start. Anything else goes to to_numpy."""
    if arr.null_count or not (pa.types.is_integer(arr.type) or pa.types.is_boolean(arr.type)):
        return arr.to_numpy(zero_copy_only=False)
    data, n, at = arr.buffers()[1], len(arr), arr.offset
    if pa.types.is_boolean(arr.type):
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
        return bits[at:at + n].astype(bool)
    dtype = np.dtype(str(arr.type))  # int8 ... uint64: numpy's names
    return np.frombuffer(data, dtype=dtype, count=n, offset=at * dtype.itemsize)


def _arrow(ds):
    """The Arrow table of a datasets.Dataset, or ``ds`` when it is one."""
    if not hasattr(ds, "data"):
        return ds
    return ds.data.table if hasattr(ds.data, "table") else ds.data


def record_lengths(ds) -> np.ndarray:
    table = _arrow(ds)
    return np.diff(table.column("input_ids").combine_chunks().offsets.to_numpy())


def pack(lengths: np.ndarray, seq_len: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing of records (by length) into rows of ``seq_len`` tokens.

    Every record lands in exactly one row, whole; deterministic (ties by record index).
    """
    if len(lengths) and int(lengths.max()) > seq_len:
        raise ValueError(f"a record of {int(lengths.max())} tokens does not fit seq_len={seq_len}")
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (remaining capacity, row), sorted
    smallest = int(lengths.min()) if len(lengths) else 1
    for d in np.argsort(-lengths, kind="stable"):
        n = int(lengths[d])
        k = bisect.bisect_left(free, (n, -1))
        if k == len(free):
            rows.append([int(d)])
            cap, row = seq_len - n, len(rows) - 1
        else:
            cap, row = free.pop(k)
            rows[row].append(int(d))
            cap -= n
        if cap >= smallest:
            bisect.insort(free, (cap, row))
    return rows


@dataclass
class Packed:
    """A split as rows of records: row r holds records ``docs[row_ptr[r]:row_ptr[r+1]]``."""

    store: TokenStore
    row_ptr: np.ndarray
    docs: np.ndarray
    seq_len: int
    pad_id: int

    @classmethod
    def build(cls, store: TokenStore, seq_len: int, pad_id: int, packing: bool) -> "Packed":
        rows = pack(store.lengths, seq_len) if packing else [[i] for i in range(len(store))]
        row_ptr = np.zeros(len(rows) + 1, dtype=np.int64)
        row_ptr[1:] = np.cumsum([len(r) for r in rows])
        docs = np.fromiter((d for r in rows for d in r), dtype=np.int64, count=int(row_ptr[-1]))
        return cls(store, row_ptr, docs, seq_len, pad_id)

    def __len__(self) -> int:
        return len(self.row_ptr) - 1

    @property
    def efficiency(self) -> float:
        """Non-pad tokens / all tokens in the rows."""
        return float(self.store.lengths.sum()) / max(1, len(self) * self.seq_len)

    def batch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """Rows → ``input_ids`` / ``labels`` (shifted) / ``position_ids``, each [len(rows), seq_len].

        A negative row id gives a dummy row (all pad, no labels) that keeps shapes and the
        number of batches equal across ranks.
        """
        b, t = len(rows), self.seq_len
        ids = np.full((b, t), self.pad_id, dtype=np.int64)
        labels = np.full((b, t), IGNORE_INDEX, dtype=np.int64)
        pos = np.tile(np.arange(t, dtype=np.int64), (b, 1))
        for i, r in enumerate(rows):
            if r < 0:
                continue
            at = 0
            for d in self.docs[self.row_ptr[r]:self.row_ptr[r + 1]]:
                x, m = self.store.record(int(d))
                n = len(x)
                ids[i, at:at + n] = x
                labels[i, at:at + n - 1] = np.where(m[1:] > 0, x[1:], IGNORE_INDEX)
                pos[i, at:at + n] = np.arange(n)
                at += n
            # padding continues the last record's positions, so it forms no extra segment
            pos[i, at:] = np.arange(n, n + t - at)
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(pos)}

