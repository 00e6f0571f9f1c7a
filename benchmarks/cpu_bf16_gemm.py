"""bf16 products on the CPU: torch's kernels against llama_fsdp/model/cpu_gemm.py's fp32 GEMMs.

Times one linear (1024x256 by 768x256) and one forward + backward of the tiny Llama (batch 4 x
128) in fp32, in bf16 with torch's kernels, and in bf16 routed through fp32 GEMMs, on one
thread. An AVX2-only CPU is emulated on a newer x86 one by limiting torch's and oneDNN's
instruction sets:

    .venv/bin/python benchmarks/cpu_bf16_gemm.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python benchmarks/cpu_bf16_gemm.py

Prints a markdown table row per case (benchmarks/cpu_bf16_gemm.md keeps them).
"""
from __future__ import annotations

import os
import time

import torch

from llama_fsdp.model import cpu_gemm


def best_of(fn, n: int = 5) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, w = torch.randn(1024, 256), torch.randn(768, 256)
    cfg = LlamaConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=768, vocab_size=512,
                      attn_implementation="sdpa")
    ids = torch.randint(0, 512, (4, 128))
    models = {dt: LlamaForCausalLM(cfg).to(dt) for dt in (torch.float32, torch.bfloat16)}

    def step(dt):
        return lambda: models[dt](input_ids=ids, labels=ids).loss.backward()

    def row(name, dt):
        lin = best_of(lambda: torch.nn.functional.linear(x.to(dt), w.to(dt)), 20)
        print(f"| {name} | {lin:.2f} | {best_of(step(dt), 3):.0f} |", flush=True)

    isa = os.environ.get("ATEN_CPU_CAPABILITY", torch.backends.cpu.get_cpu_capability())
    print(f"torch {torch.__version__}, capability {isa}, oneDNN bf16 kernels: "
          f"{cpu_gemm.native_bf16_gemm()}\n")
    print("| case | linear ms | tiny Llama fwd+bwd ms |\n|---|---:|---:|")
    row("fp32", torch.float32)
    row("bf16, torch's kernels", torch.bfloat16)
    os.environ[cpu_gemm.ENV] = cpu_gemm.FP32
    cpu_gemm.install("cpu", torch.bfloat16)
    row("bf16 as fp32 GEMMs (cpu_gemm)", torch.bfloat16)


if __name__ == "__main__":
    main()
