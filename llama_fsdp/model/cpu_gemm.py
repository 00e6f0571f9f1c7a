"""bf16 matrix products on CPUs that have no bf16 GEMM kernels.

On x86 CPUs without AVX-512 (most AMD EPYC before Zen 4, most laptops before 2023), torch's
bf16 ``mm`` does not reach oneDNN and falls back to a scalar loop: measured on an AVX2-only
EPYC with torch 2.13, F.linear of 1024x256 by 768x256 takes 9.9 ms in fp32 and 69.6 ms in bf16,
and a tiny-Llama bf16 step is 10x the fp32 step (pytorch/pytorch#146508). There, a bf16 run
(``precision=bf16`` or ``mixed``) computes its products as fp32 GEMMs of the bf16 values,
rounded back to bf16: what a bf16 GEMM with fp32 accumulation computes (the native kernels
accumulate in fp32 too), up to the order of the sums. Activations, gradients and saved tensors
stay bf16; each product holds its operands in fp32 only while it runs.

``LLAMA_FSDP_CPU_BF16_GEMM``: ``auto`` (the default: only where oneDNN has no bf16 kernels,
by config/cpu_bf16.py's torch-free check, which the planner asks too), ``fp32`` (always on the
CPU), ``native`` (never).

The products are overridden at the dispatcher (aten's CPU kernels of ``mm``, ``bmm`` and
``addmm``, with their ``out=`` and in-place forms), so autograd's backward products,
activation-checkpoint recomputation, LoRA, NF4's dequantized linears and the chunked loss's head all take them, with no change to the model
code. Installed once per process by ``install`` (model building, and loading an HF folder for
eval and generation); a process that never runs bf16 on the CPU never installs it.
"""
from __future__ import annotations

import logging
import warnings
from typing import Optional

import torch

from ..config import cpu_bf16

log = logging.getLogger(__name__)

_lib: Optional[torch.library.Library] = None  # kept alive: dropping it removes the kernels


def native_bf16_gemm() -> bool:
    """torch's own answer to config/cpu_bf16.py ``has_bf16_gemm`` (which the torch-free
    planner asks): whether its CPU bf16 products reach oneDNN's kernels
    (``mkldnn_bf16_device_check``)."""
    return bool(torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def wanted(device: str, dtype: torch.dtype) -> bool:
    """Whether products of ``dtype`` on ``device`` should run as fp32 GEMMs here."""
    return cpu_bf16.routes(device, str(dtype).removeprefix("torch."))


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
        for name, kernel in _KERNELS.items():
            lib.impl(name, kernel, "CPU")
    _lib = lib
    why = ("no bf16 GEMM kernels on this CPU" if cpu_bf16.mode() == cpu_bf16.AUTO
           else f"{cpu_bf16.ENV}={cpu_bf16.FP32}")
    log.info("bf16 products run as fp32 GEMMs of the bf16 values, rounded to bf16: %s", why)
    return True


def uninstall() -> None:
    """Back to torch's kernels (tests)."""
    global _lib
    if _lib is not None:
        _lib._destroy()
        _lib = None


# Every product below ends in one GEMM the overrides never replace, ``bmm.out`` (a batch of one
# for a matrix product), so nothing recurses; products in other dtypes take it too (the same
# kernels: a bf16 run has few fp32 products).
_BF16 = torch.bfloat16
_bmm_out = torch.ops.aten.bmm.out


def _routed(*ts: torch.Tensor) -> bool:
    return all(t.dtype is _BF16 for t in ts)


def _gemm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b computed in ``dtype`` (2-D); operands of two dtypes refused as torch's kernels do."""
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {a.dtype} != "
                           f"{b.dtype}")
    out = a.new_empty((1, a.shape[0], b.shape[1]), dtype=dtype)
    return _bmm_out(a.to(dtype)[None], b.to(dtype)[None], out=out)[0]


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _routed(a, b):
        return _gemm(a, b, torch.float32).to(_BF16)
    return _gemm(a, b, a.dtype)


def _mm_out(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    res = _gemm(a, b, torch.float32 if _routed(a, b) else a.dtype)
    out.resize_(res.shape)
    return out.copy_(res)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected scalar type {a.dtype} but found {b.dtype}")
    dtype = torch.float32 if _routed(a, b) else a.dtype
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]), dtype=dtype)
    return _bmm_out(a.to(dtype), b.to(dtype), out=out).to(a.dtype)


def _addmm32(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta, alpha) -> torch.Tensor:
    dtype = torch.float32 if _routed(c, a, b) else a.dtype
    res = _gemm(a, b, dtype)
    if alpha != 1:
        res.mul_(alpha)
    return res.add_(c.to(dtype), alpha=beta) if beta != 0 else res


def _addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    return _addmm32(c, a, b, beta, alpha).to(a.dtype)


def _addmm_out(c, a, b, *, beta=1, alpha=1, out: torch.Tensor) -> torch.Tensor:
    res = _addmm32(c, a, b, beta, alpha)
    out.resize_(res.shape)
    return out.copy_(res)


def _addmm_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    return c.copy_(_addmm32(c, a, b, beta, alpha))


_KERNELS = {"mm": _mm, "mm.out": _mm_out, "bmm": _bmm, "addmm": _addmm, "addmm.out": _addmm_out,
            "addmm_": _addmm_}
