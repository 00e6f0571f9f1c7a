"""Precision policies train; activation checkpointing and compile keep the loss, change memory."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import make_spec
from tests.distributed import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

BASE = ["tracking.enabled=false", "eval.every_steps=0", "cluster.nproc_per_node=2",
        "train.batch_size=4"]


def _spec(tag: str, *extra: str, steps: int = 5):
    return make_spec([*BASE, f"train.max_steps={steps}", "train.warmup_steps=1", *extra],
                     output_dir=f"/tmp/llama_fsdp_test/prec_{tag}")


ROUTED = "bf16_fp32_gemm"  # precision=bf16 with LLAMA_FSDP_CPU_BF16_GEMM=fp32 in the ranks


def _saved_activation_bytes(model, batch) -> int:
    """Bytes autograd keeps for backward during one forward: the activation memory."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    from llama_fsdp.model.attention import model_inputs

    inputs = model_inputs(model, {k: v for k, v in batch.items() if k != "labels"},
                          torch.device("cpu"))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(**inputs).logits
    logits.float().sum().backward()
    return total


def _run(rank, world, specs, measure):
    import torch.distributed as dist

    from llama_fsdp.data import build_data
    from llama_fsdp.train.worker import DistEnv, build_model, train_on_rank

    from torch._dynamo.utils import counters

    import os

    from llama_fsdp.config import cpu_bf16
    from llama_fsdp.model import cpu_gemm

    out = {}
    for name, spec in specs.items():
        counters.clear()
        if name == ROUTED:  # bf16 products as fp32 GEMMs, as on a CPU without bf16 kernels
            os.environ[cpu_bf16.ENV] = cpu_bf16.FP32
        r = train_on_rank(spec, DistEnv(rank, rank, world, world), torch.device("cpu"))
        routed = cpu_gemm.installed()
        if name == ROUTED or routed:  # the next run starts from torch's kernels and the env
            os.environ.pop(cpu_bf16.ENV, None)
            cpu_gemm.uninstall()
        # what TorchDynamo compiled during this run: frames turned into graphs, and the
        # AOTAutograd (forward + backward) compilations of them
        compiled = {"frames": counters["frames"]["ok"],
                    "graphs": counters["stats"]["unique_graphs"],
                    "aot_autograd": counters["aot_autograd"]["ok"]}
        out[name] = {"losses": r.losses, "compiled": compiled, "routed": routed}
        if name in measure:
            model = build_model(spec, torch.device("cpu"))
            data = build_data(spec.data, seq_len=spec.train.seq_len,
                              micro_batch=spec.train.batch_size, dp_rank=dist.get_rank(),
                              dp_world=world, seed=0, cache_dir=__import__("pathlib").Path(spec.cache_dir),
                              vocab_size=spec.model.vocab_size)
            out[name]["saved_bytes"] = _saved_activation_bytes(model, next(data.train_batches()))
    return out


@pytest.fixture(scope="session")
def results():
    specs = {
        "fp32": _spec("fp32"),
        "ac_full": _spec("ac_full", "checkpointing=full"),
        "ac_selective": _spec("ac_sel", "checkpointing=selective"),
        "compile": _spec("compile", "train.compile=true"),
        "bf16": _spec("bf16", "precision=bf16", steps=15),
        "mixed": _spec("mixed", "precision=mixed", steps=15),
        ROUTED: _spec("bf16_routed", "precision=bf16", steps=15),
    }
    return run_ranks(_run, 2, specs, {"fp32", "ac_full", "ac_selective"}, timeout=900)[0]


def test_activation_checkpointing_keeps_the_loss(results):
    ref = results["fp32"]["losses"]
    for name in ("ac_full", "ac_selective"):
        torch.testing.assert_close(results[name]["losses"], ref, rtol=1e-5, atol=1e-5, msg=name)


def test_activation_checkpointing_saves_activation_memory(results):
    none, full = results["fp32"]["saved_bytes"], results["ac_full"]["saved_bytes"]
    selective = results["ac_selective"]["saved_bytes"]
    assert full < selective < none
    assert full < 0.5 * none  # only each layer's input (+ head/loss) is kept


def test_compile_compiles_and_keeps_the_loss(results):
    # train.compile=true really compiled (a silent no-op would compile nothing), and
    # nothing is compiled without it
    compiled = results["compile"]["compiled"]
    print(f"train.compile=true on rank 0: {compiled}")
    assert compiled["frames"] > 0 and compiled["graphs"] > 0 and compiled["aot_autograd"] > 0, \
        compiled
    assert results["fp32"]["compiled"] == {"frames": 0, "graphs": 0, "aot_autograd": 0}
    torch.testing.assert_close(results["compile"]["losses"], results["fp32"]["losses"],
                               rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
def test_low_precision_trains(precision, results):
    losses = results[precision]["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3


def test_bf16_as_fp32_gemms_follows_the_bf16_curve(results):
    """model/cpu_gemm.py: where the CPU has no bf16 kernels, a bf16 run's products are fp32
    GEMMs of its bf16 values; the run is routed from its model's building, and trains as bf16
    does (the two differ only in the order of each product's sums)."""
    from llama_fsdp.model import cpu_gemm

    routed, bf16 = results[ROUTED], results["bf16"]
    assert routed["routed"] and not results["fp32"]["routed"]
    assert bf16["routed"] is (not cpu_gemm.native_bf16_gemm())
    print("bf16", bf16["losses"], "\nfp32 GEMMs", routed["losses"])
    torch.testing.assert_close(routed["losses"][:5], bf16["losses"][:5], rtol=1e-2, atol=0)
    torch.testing.assert_close(routed["losses"], bf16["losses"], rtol=3e-2, atol=0)
