"""GPU: torch.cuda.max_memory_allocated of real training steps against the plan, 1b shape.

One CUDA rank (NCCL process group of 1, in this process), Llama 3.2 1B's layer, head and
vocabulary shape with 4 of its 16 layers, seq_len 2048; full and grad_op sharding x AC none /
full x bf16 / mixed x micro-batch 1 and 4. The peak of the second step (the first with AdamW
state) is read with torch.cuda.max_memory_allocated, less the allocations still live before the
model was built; what stays allocated after the model and optimizer are deleted (cuBLAS
workspaces) is the process overhead and is subtracted too, as in
tests/multirank/test_plan_memory.py.

Asserted: plan.predicted_peak_bytes (the per-phase model, llama_fsdp.plan.phase_peaks with
NCCL, i.e. no gloo reduce-scatter copy) is within 10% of the measured peak: that measurement is
the check (comparing the prediction with phase_peak_bytes would compare the plan with itself).
The batches are unpacked input_ids, so the specs set data.packing=false (no 4-D document mask
term).
"""
from __future__ import annotations

import gc

import pytest


torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GB = 10**9
LAYERS, SEQ_LEN = 4, 2048
MODEL_TOLERANCE = 0.10
MAX_OVERHEAD = 2 * GB
CASES = [(s, p, ac, b) for s in ("full", "grad_op") for p in ("bf16", "mixed")
         for ac in ("none", "full") for b in (1, 4)]


def _spec(strategy: str, precision: str, ac: str, batch: int):
    from tests.conftest import make_spec

    return make_spec(["tracking.enabled=false", "model=1b", f"model.num_layers={LAYERS}",
                      "cluster.device=cuda", "cluster.nproc_per_node=1", f"sharding={strategy}",
                      f"precision={precision}", f"checkpointing={ac}",
                      f"train.batch_size={batch}", f"train.seq_len={SEQ_LEN}",
                      "data.packing=false",  # _measure feeds unpacked input_ids
                      "train.loss=full"],  # as measured (the chunked loss: test_gpu_long_context)
                     output_dir="/tmp/llama_fsdp_test/gpu_memory")


def _measure(spec) -> tuple[int, int]:
    """(peak bytes of step 2 above the pre-build allocation, bytes left after teardown)."""
    from llama_fsdp.train.optimizer import build_optimizer
    from llama_fsdp.train.loop import build_scheduler, train_step
    from llama_fsdp.train.worker import build_model, compile_cache

    device = torch.device("cuda", 0)
    t = spec.train
    gen = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(2):
        ids = torch.randint(0, spec.model.vocab_size, (t.batch_size, t.seq_len), generator=gen)
        steps.append([{"input_ids": ids, "labels": ids.clone()}])
    gc.collect()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    model = build_model(spec, device)
    optimizer = build_optimizer(model, t, spec.optim,  # a compiled step's cache as the worker's
                                compile_dir=compile_cache(spec, model, 0))
    scheduler = build_scheduler(optimizer, t)
    train_step(model, optimizer, scheduler, steps[0], device=device,
               max_grad_norm=t.max_grad_norm)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    train_step(model, optimizer, scheduler, steps[1], device=device,
               max_grad_norm=t.max_grad_norm)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del model, optimizer, scheduler
    gc.collect()
    torch.cuda.synchronize(device)
    left = torch.cuda.memory_allocated(device) - base
    torch.cuda.empty_cache()
    return peak, left


def tensor_prediction(plan) -> int:
    """The plan's peak less the CUDA workspaces it counts in every phase (plan.device's
    runtime_bytes): what ``measured`` holds, the step's tensors, since the workspaces are
    either made before ``base`` (an earlier test in this process) or subtracted as
    ``overhead``."""
    from llama_fsdp.plan.device import runtime_bytes

    return plan.predicted_peak_bytes - runtime_bytes(plan.spec)


def peak_result(config: str, measured: int, overhead: int, plan) -> dict:
    """What the GPU check's results keep of a peak test (benchmarks/gpu_check_pytest.py)."""
    return {"config": config, "measured_gb": measured / GB, "overhead_gb": overhead / GB,
            "predicted_gb": tensor_prediction(plan) / GB, "peak_phase": plan.peak_phase}


@pytest.mark.parametrize("strategy,precision,ac,batch", CASES)
def test_cuda_peak_is_within_tolerance_of_the_plan(one_rank_group, record_property, strategy,
                                                   precision, ac, batch):
    from llama_fsdp.plan import make_plan

    spec = _spec(strategy, precision, ac, batch)
    plan = make_plan(spec)
    peak, overhead = _measure(spec)
    measured = peak - overhead
    predicted, total = tensor_prediction(plan), plan.memory.total - plan.memory.runtime
    text = (f"{strategy} {precision} AC {ac} b={batch}: measured {measured / GB:.3f} GB "
            f"(overhead {overhead / GB:.3f}), predicted {predicted / GB:.3f} GB "
            f"({measured / predicted:.3f}, peak in {plan.peak_phase}), sum of components "
            f"{total / GB:.3f} GB ({measured / total:.3f})")
    print(text)
    record_property("result", peak_result(f"{strategy} {precision} AC {ac} b={batch}", measured,
                                          overhead, plan))
    assert 0 <= overhead <= MAX_OVERHEAD, text
    assert abs(measured / predicted - 1) <= MODEL_TOLERANCE, text
