"""benchmarks/long_context.md's NF4 rows: the heap peak of one NF4 linear's forward and of its
backward (each dequantizes the weight) on the CPU, torchao's linear_nf4 against nf4.linear, in
bf16 and fp32, eager and (``--compile``) under torch.compile, against the plan's term
(nf4.dequantize_bytes). Each case runs in a fresh process with benchmarks/plan_vs_measured.py's
malloc shim preloaded (torch's CPU allocator is malloc); the peak is over the heap before the
call (the NF4 weight and the input already there).

    .venv/bin/python benchmarks/nf4_memory.py [--rows 8192 --cols 4096] [--compile]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TOKENS = 16  # rows of the input: the matmul's own output is small beside the weight


def one(impl: str, dtype_name: str, rows: int, cols: int, compiled: bool) -> str:
    """Run in the preloaded child: one case's row of the table."""
    import torch

    from benchmarks.plan_vs_measured import Heap
    from llama_fsdp.config import nf4

    dtype = getattr(torch, dtype_name)
    q = nf4.nf4_module().to_nf4(torch.randn(rows, cols, dtype=dtype), 64, 256)
    x = torch.randn(TOKENS, cols, dtype=dtype, requires_grad=True)
    f = nf4.nf4_module().linear_nf4 if impl == "torchao" else nf4.linear
    fn = torch.compile(lambda x: f(x, q), dynamic=False) if compiled else (lambda x: f(x, q))
    y = fn(x)
    grad = torch.ones_like(y)
    y.backward(grad)  # a warm-up (and the compile)
    del y
    x.grad = None
    heap = Heap()
    heap.take_peak()
    before = heap.current()
    y = fn(x)
    forward = heap.take_peak() - before
    before = heap.current()
    y.backward(grad)
    backward = heap.take_peak() - before
    n, c = rows * cols, dtype.itemsize
    plan = nf4.dequantize_bytes(n, dtype_bytes=c, block_size=64, scaler_block_size=256)
    return (f"| {impl}{' (compiled)' if compiled else ''} | {dtype_name} | {rows:,} x {cols:,} "
            f"| {forward / n:.3f} | {backward / n:.3f} | {plan / n:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--compile", action="store_true", help="also under torch.compile")
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(one(a.one[0], a.one[1], a.rows, a.cols, a.one[2] == "compiled"))
        return
    from benchmarks.plan_vs_measured import build_memtrack, preloaded

    lib = build_memtrack()
    if lib is None:
        sys.exit("needs a C compiler (cc) on Linux to build the malloc shim")
    print("| linear | dtype | weight | forward peak, bytes a weight | backward | planned |")
    print("|---|---|---|---|---|---|")
    for mode in ("eager", "compiled") if a.compile else ("eager",):
        for impl in ("torchao", "lean"):
            for dtype in ("bfloat16", "float32"):
                with preloaded(lib):
                    done = subprocess.run(
                        [sys.executable, __file__, "--rows", str(a.rows), "--cols", str(a.cols),
                         "--one", impl, dtype, mode, "-"], capture_output=True, text=True)
                rows = [ln for ln in done.stdout.splitlines() if ln.startswith("|")]
                print(rows[-1] if rows else f"| {impl} {dtype} {mode}: failed: "
                      f"{done.stderr.strip().splitlines()[-1:]} |", flush=True)


if __name__ == "__main__":
    main()
