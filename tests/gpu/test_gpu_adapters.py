"""GPU: finetune=lora / qlora on CUDA. QLoRA in bf16 with torch.compile and activation
checkpointing trains through the command users type (loss falls, the PEFT adapter is
exported); and torch.cuda.max_memory_allocated of real steps against the plan (1b's shape with
4 of its layers, seq 2048, one rank: the peak of the second step, less what stays allocated
after teardown, within 10% of plan.predicted_peak_bytes), as tests/gpu/test_gpu_memory.py does
for full fine-tuning.

Skipped without CUDA; run with `pytest -m gpu tests/gpu/test_gpu_adapters.py`.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest


torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GB = 10**9
CASES = [(m, p, ac, b) for m in ("lora", "qlora") for p in ("bf16", "mixed")
         for ac in ("none", "full") for b in (1, 2)]


def test_qlora_bf16_compiled_trains_and_exports_its_adapter(tmp_path):
    from tests.gpu.test_gpu_run import SHORT, _run, _run_record

    code, log = _run(tmp_path, *SHORT, "finetune=qlora", "precision=bf16", "train.compile=true",
                     "checkpointing=full", "cluster.nproc_per_node=1")
    assert code == 0, log[-4000:]
    client, run = _run_record(tmp_path)
    losses = [x.value for x in client.get_metric_history(run.info.run_id, "loss")]
    assert len(losses) == 12 and losses[-1] < losses[0], losses
    export = Path(run.data.tags["export_dir"])
    config = json.loads((export / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and (export / "adapter_model.safetensors").is_file()
    m = run.data.metrics
    print(f"qlora bf16 compile: {m['summary/tokens_per_sec']:.0f} tok/s, MFU "
          f"{m.get('summary/mfu', 0):.2%}, peak {m['summary/peak_memory_gb']:.3f} GB (plan "
          f"{m['summary/predicted_peak_memory_gb']:.3f})")


@pytest.mark.parametrize("options", [["finetune=lora", "sharding.cpu_offload=true"],
                                     ["finetune=qlora", "sharding=no_shard"],
                                     ["finetune=lora", "sharding=grad_op", "finetune.dropout=0.1",
                                      "checkpointing=full"]],
                         ids=["lora-offload", "qlora-ddp", "lora-grad_op-dropout-ac"])
def test_adapters_train_with_each_option(tmp_path, options):
    from tests.gpu.test_gpu_run import SHORT, _run, _run_record

    code, log = _run(tmp_path, *SHORT, *options)
    assert code == 0, log[-4000:]
    client, run = _run_record(tmp_path)
    losses = [x.value for x in client.get_metric_history(run.info.run_id, "loss")]
    assert len(losses) == 12 and losses[-1] < losses[0], losses


def _spec(method: str, precision: str, ac: str, batch: int):
    from tests.conftest import make_spec

    return make_spec(["tracking.enabled=false", "model=1b", "model.num_layers=4",
                      "cluster.device=cuda", "cluster.nproc_per_node=1", f"finetune={method}",
                      f"precision={precision}", f"checkpointing={ac}",
                      f"train.batch_size={batch}", "train.seq_len=2048", "data.packing=false"],
                     output_dir="/tmp/llama_fsdp_test/gpu_adapters")


@pytest.mark.parametrize("method,precision,ac,batch", CASES)
def test_cuda_peak_of_adapters_is_within_tolerance_of_the_plan(one_rank_group, record_property,
                                                               method, precision, ac, batch):
    from llama_fsdp.plan import make_plan
    from tests.gpu.test_gpu_memory import (MAX_OVERHEAD, MODEL_TOLERANCE, _measure, peak_result,
                                          tensor_prediction)

    spec = _spec(method, precision, ac, batch)
    plan = make_plan(spec)
    peak, overhead = _measure(spec)
    measured, predicted = peak - overhead, tensor_prediction(plan)
    text = (f"{method} {precision} AC {ac} b={batch}: measured {measured / GB:.3f} GB "
            f"(overhead {overhead / GB:.3f}), predicted {predicted / GB:.3f} GB "
            f"({measured / predicted:.3f}, peak in {plan.peak_phase})")
    print(text)
    record_property("result", peak_result(f"{method} {precision} AC {ac} b={batch}", measured,
                                          overhead, plan))
    assert 0 <= overhead <= MAX_OVERHEAD, text
    assert abs(measured / predicted - 1) <= MODEL_TOLERANCE, text
