"""Whether this machine's CPU has bf16 GEMM kernels, asked without torch (the planner and the
command line are torch-free), and so whether a bf16 run on the CPU computes its products as
fp32 GEMMs (llama_fsdp/model/cpu_gemm.py, which routes them; the planner counts their fp32
operands).

torch's bf16 products reach oneDNN where oneDNN can run bf16: x86 with AVX-512 (avx512f, bw,
vl, dq: oneDNN's ``avx512_core``) or AVX-NE-CONVERT (``avx2_vnni_2``), unless
``ONEDNN_MAX_CPU_ISA`` caps oneDNN below them; ARM with the bf16 extension. Elsewhere torch
runs a scalar loop, about 20x slower than an fp32 GEMM (benchmarks/cpu_bf16_gemm.md).
tests/unit/test_cpu_gemm.py holds this answer equal to torch's own check.

``LLAMA_FSDP_CPU_BF16_GEMM``: ``auto`` (the default: route only where the CPU has no bf16
kernels), ``fp32`` (always route on the CPU), ``native`` (never).
"""
from __future__ import annotations

import functools
import os
import platform
from pathlib import Path
from typing import Mapping

ENV = "LLAMA_FSDP_CPU_BF16_GEMM"
AUTO, FP32, NATIVE = "auto", "fp32", "native"
MODES = (AUTO, FP32, NATIVE)

AVX512_CORE = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA) below its first with bf16 kernels
BELOW_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI"})
CPUINFO = Path("/proc/cpuinfo")


def mode() -> str:
    """``LLAMA_FSDP_CPU_BF16_GEMM``, checked."""
    value = os.environ.get(ENV, AUTO).strip().lower() or AUTO
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def _flags(text: str, key: str) -> frozenset[str]:
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() == key:
            return frozenset(value.split())
    return frozenset()


@functools.lru_cache(maxsize=1)
def has_bf16_gemm() -> bool:
    """Whether torch's bf16 products on this machine's CPU run in oneDNN's kernels. Unknown
    CPUs (no /proc/cpuinfo: macOS, Windows) count as having them: nothing is routed there."""
    try:
        cpuinfo = CPUINFO.read_text()
    except OSError:
        return True
    return reads_bf16_gemm(cpuinfo, platform.machine(), os.environ)


def reads_bf16_gemm(cpuinfo: str, machine: str, env: Mapping[str, str]) -> bool:
    """``has_bf16_gemm`` for a /proc/cpuinfo text, an architecture and an environment."""
    machine = machine.lower()
    if machine in ("x86_64", "amd64", "i686"):
        if env.get("ONEDNN_MAX_CPU_ISA", "").strip().upper() in BELOW_BF16:
            return False
        flags = _flags(cpuinfo, "flags")
        return AVX512_CORE <= flags or "avx_ne_convert" in flags
    if machine in ("aarch64", "arm64"):
        return "bf16" in _flags(cpuinfo, "features")
    return True


def routes(device: str, compute_dtype: str) -> bool:
    """Whether a run computing in ``compute_dtype`` (a dtype name) on ``device`` has its
    products computed as fp32 GEMMs of its bf16 values."""
    if device != "cpu" or compute_dtype != "bfloat16":
        return False
    m = mode()
    return m == FP32 or (m == AUTO and not has_bf16_gemm())
