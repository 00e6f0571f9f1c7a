"""Attention over packed rows on CPU: varlen's block-sparse SDPA against SDPA's dense mask.

    .venv/bin/python benchmarks/attention_cpu.py --out benchmarks/attention_cpu.md

Forward + backward of one attention call (no projections) per shape, on one torch thread:
SDPA with transformers' dense b x 1 x s x s block-causal mask (what ``sdpa`` runs on packed
rows), SDPA's causal path over the whole row (what an unpacked run or a loop that ignores the
records runs: wrong for packed rows, and the speed to beat), and llama_fsdp's block-sparse plan
(``attention.chunk_plan`` + ``block_sparse_attention``) at every chunk size and at the size its
cost model picks. Rows are packed from records of random length in the given range (fixed
seed); every plan's output and gradients are checked against the dense mask's first.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llama_fsdp.model.attention import CHUNK_SIZES, block_sparse_attention, chunk_plan  # noqa: E402

# (label, batch, heads, kv heads, seq, head dim, record lengths)
SHAPES = [
    ("tiny default (synthetic records)", 8, 8, 4, 128, 32, (4, 21)),
    ("1b heads, seq 512, chat-length records", 2, 32, 8, 512, 64, (30, 200)),
    ("1b heads, seq 2048, instruction records", 1, 32, 8, 2048, 64, (50, 400)),
    ("1b heads, seq 2048, records of 1500-2048 tokens", 1, 32, 8, 2048, 64, (1500, 2048)),
]


def packed_positions(batch: int, seq: int, lengths: tuple[int, int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pos = np.zeros((batch, seq), dtype=np.int64)
    for row in pos:
        at = 0
        while at < seq:
            n = min(int(rng.integers(lengths[0], lengths[1] + 1)), seq - at)
            row[at:at + n] = np.arange(n)
            at += n
    return pos


def dense_mask(pos: np.ndarray) -> torch.Tensor:
    start = np.ones(pos.shape, dtype=bool)
    start[:, 1:] = np.diff(pos, axis=1) != 1
    seg = np.cumsum(start, axis=1)
    idx = np.arange(pos.shape[1])
    mask = (seg[:, :, None] == seg[:, None, :]) & (idx[:, None] >= idx[None, :])
    return torch.from_numpy(mask)[:, None]


def timed(fn, budget_s: float, rounds: int) -> float:
    """Median ms per call over ``rounds`` rounds of about budget_s / rounds each."""
    fn()
    t0 = time.perf_counter()
    fn()
    per = time.perf_counter() - t0
    n = max(1, int(budget_s / rounds / max(per, 1e-6)))
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(out)


def measure(label, b, h, kv, s, d, lengths, budget_s, rounds) -> list[str]:
    pos = packed_positions(b, s, lengths, seed=0)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=gen, requires_grad=True) for n in (h, kv, kv))
    grad = torch.randn(b, s, h, d, generator=gen)
    mask = dense_mask(pos)

    def dense():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              enable_gqa=True).transpose(1, 2)

    def causal():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=True).transpose(1, 2)

    def plan(size=None):
        chunks = [(a, z, lo, torch.from_numpy(m))
                  for a, z, lo, m in chunk_plan(pos, heads=h, kv_heads=kv, head_dim=d, size=size)]
        return lambda: block_sparse_attention(q, k, v, chunks, None)

    def step(fn):
        return lambda: torch.autograd.grad(fn(), (q, k, v), grad)

    want = dense()
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    sizes = [n for n in CHUNK_SIZES if n < s]
    cases = {"SDPA, dense block-causal mask": dense, "SDPA causal (ignores the records)": causal}
    for n in sizes:
        cases[f"block-sparse, chunk {n}"] = plan(n)
    picked = chunk_plan(pos, heads=h, kv_heads=kv, head_dim=d)
    picked_size = picked[0][1] - picked[0][0]
    cases[f"block-sparse, chunk picked ({picked_size})"] = plan()
    for name, fn in cases.items():
        if name.startswith("block-sparse"):
            got = fn()
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
            for g, w in zip(torch.autograd.grad(got, (q, k, v), grad), want_grads):
                torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-3)
    ms = {name: timed(step(fn), budget_s / len(cases), rounds) for name, fn in cases.items()}
    records = int(np.mean((pos == 0).sum(axis=1)))
    base = ms["SDPA, dense block-causal mask"]
    best = min(v for n, v in ms.items()
               if n.startswith("block-sparse, chunk ") and "picked" not in n)
    lines = [f"### {label}", "",
             f"b={b}, heads={h}, kv heads={kv}, seq={s}, head dim={d}; records of {lengths[0]}-"
             f"{lengths[1]} tokens, {records} per row on average; picked chunk {picked_size} "
             f"({ms[f'block-sparse, chunk picked ({picked_size})'] / best:.2f}x the best size)", "",
             "| kernel | ms (fwd + bwd) | vs dense mask |", "|---|---:|---:|"]
    lines += [f"| {name} | {v:.2f} | {base / v:.2f}x |" for name, v in ms.items()]
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=40.0, help="seconds of timing per shape")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    head = ["# Attention over packed rows on CPU", "",
            f"Measured {time.strftime('%Y-%m-%d %H:%M')} with `.venv/bin/python "
            f"benchmarks/attention_cpu.py{' --out ' + str(args.out) if args.out else ''}`: "
            f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
            "1 torch thread; forward + backward of one attention call, the median of "
            f"{args.rounds} rounds. Every block-sparse plan's output and gradients equal the "
            "dense mask's (checked before timing).", ""]
    body = []
    for shape in SHAPES:
        body += measure(*shape, budget_s=args.budget, rounds=args.rounds)
        print("\n".join(body[-12:]), flush=True)
    text = "\n".join(head + body)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
