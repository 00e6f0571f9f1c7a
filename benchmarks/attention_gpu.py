"""Attention kernels at the 1b shape on one GPU: forward + backward time of each way this project
(or a peer) can run causal attention over packed rows, for rows of one record and rows of many.

    python benchmarks/attention_gpu.py --out attention.jsonl   # one JSON line per measurement

Shape: micro-batch 4 x 2048 tokens, 32 query heads, 8 key/value heads, head_dim 64, bf16 (Llama
3.2 1B, the GPU check's throughput shape). Record lengths per row: ``one`` (a single 2048-token
record: what the peers' random rows are), ``r256`` (256-token records), ``synthetic`` (4-12
tokens: the embedded synthetic data with the project tokenizer, which the GPU check's throughput
stage trains on). Kernels:

- ``varlen``: this project's (llama_fsdp.model.attention._flash_varlen: torch's varlen_attn, flash);
- ``sdpa_causal`` / ``sdpa_causal_cudnn`` / ``sdpa_causal_flash``: SDPA with is_causal over whole
  rows (right only for ``one``), torch's choice of backend, then cuDNN and flash forced;
- ``sdpa_mask``: SDPA with the dense block-causal boolean mask (what ``sdpa`` runs for packed rows);
- ``flex``: torch.compile'd flex_attention with the document-causal block mask (torchtitan's).

Each: 5 warm-up calls, then the median of 20 (CUDA events). ``--device cpu`` rehearses the
script with a small shape and the kernels that exist there.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def lengths(kind: str, seq: int, gen: torch.Generator) -> list[int]:
    if kind == "one":
        return [seq]
    size = {"r256": (256, 256), "synthetic": (4, 12)}[kind]
    out, left = [], seq
    while left > 0:
        n = min(left, int(torch.randint(size[0], size[1] + 1, (), generator=gen)))
        out.append(n)
        left -= n
    return out


def timed(fn, device: str, warmup: int = 5, iters: int = 20) -> float:
    """Median ms of fn() (forward + backward)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = args.device
    cpu = device == "cpu"
    b, s, hq, hkv, d = (2, 256, 4, 2, 16) if cpu else (4, 2048, 32, 8, 64)
    dtype = torch.float32 if cpu else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    from llama_fsdp.model import attention as A

    def emit(rec: dict) -> None:
        rec.update(device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                   torch=torch.__version__, shape=[b, s, hq, hkv, d])
        with args.out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)

    for kind in ("one", "r256", "synthetic"):
        lens = [lengths(kind, s, gen) for _ in range(b)]
        flat = [n for row in lens for n in row]
        cu = torch.tensor([0, *torch.tensor(flat).cumsum(0).tolist()], dtype=torch.int32,
                          device=device)
        q = torch.randn(b, hq, s, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(b, hkv, s, d, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(b, hkv, s, d, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(b, hq, s, d, device=device, dtype=dtype)
        doc = torch.cat([torch.full((n,), i) for row in lens for i, n in enumerate(row)])
        doc = doc.view(b, s).to(device)
        pos = torch.arange(s, device=device)
        causal = pos[:, None] >= pos[None, :]
        mask = (doc[:, :, None] == doc[:, None, :]) & causal  # [b, s, s]

        def run(name: str, fn) -> None:
            try:
                ms = timed(fn, device)
                emit({"kind": kind, "records": len(flat), "kernel": name, "ms": ms})
            except Exception as e:  # a kernel this torch / GPU does not have
                emit({"kind": kind, "records": len(flat), "kernel": name,
                      "error": f"{type(e).__name__}: {str(e)[:300]}"})

        def varlen():
            tq = q.transpose(1, 2).reshape(b * s, hq, d)
            tk = k.transpose(1, 2).reshape(b * s, hkv, d)
            tv = v.transpose(1, 2).reshape(b * s, hkv, d)
            out = A._flash_varlen(tq, tk, tv, cu, max(flat), d ** -0.5)
            out.backward(grad.transpose(1, 2).reshape(b * s, hq, d))

        def sdpa(backend=None, use_mask=False):
            def fn():
                from torch.nn.attention import sdpa_kernel

                kw = dict(attn_mask=mask[:, None]) if use_mask else dict(is_causal=True)
                kk, vv = (k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1))
                if backend is None:
                    out = F.scaled_dot_product_attention(q, kk, vv, **kw)
                else:
                    with sdpa_kernel(backend):
                        out = F.scaled_dot_product_attention(q, kk, vv, **kw)
                out.backward(grad)
            return fn

        if not cpu and A._VARLEN_ATTN is not None:
            run("varlen", varlen)
        from torch.nn.attention import SDPBackend

        if kind == "one":
            run("sdpa_causal", sdpa())
            if not cpu:
                run("sdpa_causal_cudnn", sdpa(SDPBackend.CUDNN_ATTENTION))
                run("sdpa_causal_flash", sdpa(SDPBackend.FLASH_ATTENTION))
        run("sdpa_mask", sdpa(use_mask=True))
        if not cpu:
            run("sdpa_mask_cudnn", sdpa(SDPBackend.CUDNN_ATTENTION, use_mask=True))
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            def doc_causal(bi, h, qi, ki):
                return (doc[bi, qi] == doc[bi, ki]) & (qi >= ki)

            block = create_block_mask(doc_causal, b, None, s, s, device=device)
            flex = torch.compile(flex_attention)
            t0 = time.perf_counter()
            flex(q, k, v, block_mask=block, enable_gqa=True).backward(grad)
            compile_s = time.perf_counter() - t0
            run("flex", lambda: flex(q, k, v, block_mask=block, enable_gqa=True).backward(grad))
            emit({"kind": kind, "kernel": "flex", "first_call_s": compile_s})
        except Exception as e:
            emit({"kind": kind, "kernel": "flex", "error": f"{type(e).__name__}: {str(e)[:300]}"})


if __name__ == "__main__":
    main()
