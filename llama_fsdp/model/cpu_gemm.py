"""bf16 matrix products on CPUs that have no bf16 GEMM kernels.

On x86 CPUs without AVX-512 (most AMD EPYC before Zen 4, most laptops before 2023), torch's
bf16 ``mm`` does not reach oneDNN and falls back to a scalar loop: measured on an AVX2-only
EPYC with torch 2.13, F.linear of 1024x256 by 768x256 takes 9.9 ms in fp32 and 69.6 ms in bf16,
and a tiny-Llama bf16 step is 10x the fp32 step (pytorch/pytorch#146508). There, a bf16 run
(``precision=bf16`` or ``mixed``) computes its products as fp32 GEMMs of the bf16 values,
rounded back to bf16: what a bf16 GEMM with fp32 accumulation computes (the native kernels
accumulate in fp32 too), up to the order of the sums. Activations, gradients and saved tensors
stay bf16; each product holds its operands in fp32 only while it runs.

``LLAMA_FSDP_CPU_BF16_GEMM``: ``auto`` (the default: only where oneDNN has no bf16 kernels),
``fp32`` (always on the CPU), ``native`` (never).

The products are overridden at the dispatcher (aten's CPU kernels of ``mm``, ``bmm`` and
``addmm``), so autograd's backward products, activation-checkpoint recomputation, LoRA, NF4's
dequantized linears and the chunked loss's head all take them, with no change to the model
code. Installed once per process by ``install`` (model building, and loading an HF folder for
eval and generation); a process that never runs bf16 on the CPU never installs it.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Optional

import torch

log = logging.getLogger(__name__)

ENV = "LLAMA_FSDP_CPU_BF16_GEMM"
AUTO, FP32, NATIVE = "auto", "fp32", "native"
MODES = (AUTO, FP32, NATIVE)

_lib: Optional[torch.library.Library] = None  # kept alive: dropping it removes the kernels


def native_bf16_gemm() -> bool:
    """Whether torch's CPU bf16 products reach oneDNN's kernels (AVX-512 or newer): the check
    torch's own matmul dispatch makes (``mkldnn_bf16_device_check``)."""
    return bool(torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def mode() -> str:
    """``LLAMA_FSDP_CPU_BF16_GEMM``, checked."""
    value = os.environ.get(ENV, AUTO).strip().lower() or AUTO
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def wanted(device: str, dtype: torch.dtype) -> bool:
    """Whether products of ``dtype`` on ``device`` should run as fp32 GEMMs here."""
    if device != "cpu" or dtype != torch.bfloat16:
        return False
    m = mode()
    return m == FP32 or (m == AUTO and not native_bf16_gemm())


def installed() -> bool:
    return _lib is not None


def install(device: str, dtype: torch.dtype) -> bool:
    """Route this process's CPU bf16 products through fp32 GEMMs when ``wanted``; idempotent.
    Returns whether they are routed."""
    global _lib
    if _lib is not None:
        return True
    if not wanted(str(device).split(":")[0], dtype):
        return False
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": intended
        warnings.simplefilter("ignore")
        lib.impl("mm", _mm, "CPU")
        lib.impl("bmm", _bmm, "CPU")
        lib.impl("addmm", _addmm, "CPU")
    _lib = lib
    why = ("no bf16 GEMM kernels on this CPU (no AVX-512)" if mode() == AUTO
           else f"{ENV}={FP32}")
    log.info("bf16 products run as fp32 GEMMs of the bf16 values, rounded to bf16: %s", why)
    return True


def uninstall() -> None:
    """Back to torch's kernels (tests)."""
    global _lib
    if _lib is not None:
        _lib._destroy()
        _lib = None


# The overrides call the ``.out`` overloads, which keep torch's own CPU kernels: the functional
# ops below are the only ones replaced, so nothing recurses.
_BF16 = torch.bfloat16


def _both_bf16(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype is _BF16 and b.dtype is _BF16


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _both_bf16(a, b):
        out = a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)
        return torch.ops.aten.mm.out(a.float(), b.float(), out=out).to(_BF16)
    return torch.ops.aten.mm.out(a, b, out=a.new_empty((0,), dtype=a.dtype))


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _both_bf16(a, b):
        out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]), dtype=torch.float32)
        return torch.ops.aten.bmm.out(a.float(), b.float(), out=out).to(_BF16)
    return torch.ops.aten.bmm.out(a, b, out=a.new_empty((0,), dtype=a.dtype))


def _addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    if _both_bf16(a, b) and c.dtype is _BF16:
        out = a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)
        return torch.ops.aten.addmm.out(c.float(), a.float(), b.float(), beta=beta, alpha=alpha,
                                        out=out).to(_BF16)
    return torch.ops.aten.addmm.out(c, a, b, beta=beta, alpha=alpha,
                                    out=a.new_empty((0,), dtype=a.dtype))
