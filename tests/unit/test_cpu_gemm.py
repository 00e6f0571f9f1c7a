"""bf16 products on CPUs without bf16 GEMM kernels (llama_fsdp/model/cpu_gemm.py).

An AVX2-only CPU is shown on any x86 machine by limiting torch's and oneDNN's instruction sets
(ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2): torch's own bf16-kernel check then says no,
as it does on such a machine.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from llama_fsdp.config import cpu_bf16
from llama_fsdp.model import cpu_gemm

AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.fixture
def routed(monkeypatch):
    """This process's bf16 products through fp32 GEMMs, and torch's kernels back afterwards
    (an earlier test in this worker may have routed them: loading a bf16 model on a CPU without
    bf16 kernels does)."""
    cpu_gemm.uninstall()
    monkeypatch.setenv(cpu_bf16.ENV, cpu_bf16.FP32)
    assert cpu_gemm.install("cpu", torch.bfloat16)
    try:
        yield
    finally:
        cpu_gemm.uninstall()


def _operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(300, 200, generator=g).bfloat16()
    b = torch.randn(200, 100, generator=g).bfloat16()
    c = torch.randn(100, generator=g).bfloat16()
    return a, b, c


def test_an_avx2_only_cpu_routes_bf16_products_and_nothing_else(monkeypatch):
    monkeypatch.delenv(cpu_bf16.ENV, raising=False)
    code = ("import torch; from llama_fsdp.model import cpu_gemm as g; "
            "from llama_fsdp.config import cpu_bf16; "
            "print(g.native_bf16_gemm(), g.wanted('cpu', torch.bfloat16), "
            "g.wanted('cpu', torch.float32), g.wanted('cuda', torch.bfloat16), "
            "cpu_bf16.has_bf16_gemm())")
    env = {**os.environ, **AVX2_ONLY}
    env.pop(cpu_bf16.ENV, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    # torch's own check and the planner's torch-free one agree
    assert out == ["False", "True", "False", "False", "False"]
    # this machine as it is: routed exactly where torch has no bf16 kernels
    assert cpu_gemm.wanted("cpu", torch.bfloat16) is (not cpu_gemm.native_bf16_gemm())
    assert cpu_bf16.has_bf16_gemm() is cpu_gemm.native_bf16_gemm()
    # and the user can turn it off there
    env[cpu_bf16.ENV] = cpu_bf16.NATIVE
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[1] == "False"


def test_routed_products_are_the_fp32_products_of_the_bf16_values_rounded(routed):
    a, b, c = _operands()
    exact = (a.float() @ b.float()).bfloat16()  # torch.mm of fp32 here: the override's own path
    assert torch.equal(a @ b, exact)
    assert torch.equal(torch.addmm(c, a, b), (c.float() + a.float() @ b.float()).bfloat16())
    assert torch.equal(torch.bmm(a[None], b[None])[0], exact)
    # the out= and in-place forms (the chunked loss writes the hidden's gradient with them)
    out = torch.empty(0, dtype=torch.bfloat16)
    assert torch.equal(torch.mm(a, b, out=out), exact) and torch.equal(out, exact)
    acc = c.expand(300, 100).clone()
    acc.addmm_(a, b)
    assert torch.equal(acc, (c.float() + a.float() @ b.float()).bfloat16())
    assert torch.equal(torch.addmm(c, a, b, beta=0.5, alpha=2, out=out),
                       (0.5 * c.float() + 2 * (a.float() @ b.float())).bfloat16())
    for out in (a @ b, torch.addmm(c, a, b), torch.bmm(a[None], b[None])):
        assert out.dtype == torch.bfloat16


def test_routed_products_are_as_accurate_as_torchs_bf16_kernels(routed):
    a, b, _ = _operands(1)
    ref = a.double() @ b.double()
    routed_err = ((a @ b).double() - ref).abs().max()
    cpu_gemm.uninstall()
    native_err = ((a @ b).double() - ref).abs().max()
    # bf16's rounding of the result dominates both (|ref| up to ~50: an ulp of 0.25)
    assert routed_err <= native_err * 1.01 + 1e-6
    cpu_gemm.install("cpu", torch.bfloat16)


def test_fp32_products_and_mixed_dtypes_keep_torchs_behaviour(routed):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(64, 32, generator=g), torch.randn(32, 16, generator=g)
    assert torch.allclose(a @ b, (a.double() @ b.double()).float(), atol=1e-5)
    assert torch.allclose(torch.bmm(a[None], b[None])[0], a @ b)
    with pytest.raises(RuntimeError, match="dtype"):
        a.bfloat16() @ b


def test_backward_products_are_routed_and_grads_stay_bf16(routed):
    a, _, _ = _operands(3)
    w = torch.randn(50, 200, dtype=torch.bfloat16, requires_grad=True)
    x = a.clone().requires_grad_()
    gy = torch.randn(300, 50).bfloat16()
    torch.nn.functional.linear(x, w).backward(gy)
    assert w.grad.dtype == x.grad.dtype == torch.bfloat16
    assert torch.equal(w.grad, (gy.float().T @ a.float()).bfloat16())
    assert torch.equal(x.grad, (gy.float() @ w.detach().float()).bfloat16())


def test_a_bad_setting_names_the_variable_and_its_values(monkeypatch):
    monkeypatch.setenv(cpu_bf16.ENV, "fast")
    with pytest.raises(ValueError, match=f"{cpu_bf16.ENV}='fast'.*auto, fp32, native"):
        cpu_gemm.wanted("cpu", torch.bfloat16)


EPYC_ZEN3 = "flags\t\t: fpu sse sse2 avx f16c fma avx2 bmi2 sha_ni clzero\n"
SAPPHIRE = ("flags\t\t: fpu avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 "
            "amx_bf16\n")


@pytest.mark.parametrize("cpuinfo,machine,env,has", [
    (EPYC_ZEN3, "x86_64", {}, False),
    (SAPPHIRE, "x86_64", {}, True),
    (SAPPHIRE, "x86_64", {"ONEDNN_MAX_CPU_ISA": "avx2"}, False),
    (SAPPHIRE, "x86_64", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, True),
    ("flags : avx2 avx_vnni avx_ne_convert\n", "x86_64", {}, True),  # Arrow Lake and the like
    ("Features\t: fp asimd sve bf16 i8mm\n", "aarch64", {}, True),  # Graviton 3
    ("Features\t: fp asimd crc32 atomics\n", "aarch64", {}, False),  # Graviton 2
    ("", "riscv64", {}, True),  # unknown: nothing routed
])
def test_the_torch_free_check_reads_the_cpus_flags(cpuinfo, machine, env, has, monkeypatch):
    assert cpu_bf16.reads_bf16_gemm(cpuinfo, machine, env) is has
