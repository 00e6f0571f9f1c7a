"""GPU: objective=dpo with LoRA on Llama 3.1 8B's shape (seeded weights: no download), one GPU,
bf16, every layer checkpointed, rows of 2048 tokens of packed synthetic pairs, through the
command users type. Tokens/s and the peak (MLflow's summary, torch.cuda.max_memory_allocated)
against the plan, and SFT with LoRA on the same shape beside it: DPO's step time per token
over SFT's, printed.

Skipped without CUDA; run with `pytest -m gpu tests/gpu/test_gpu_dpo.py`.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPE = ["model=8b", "finetune=lora", "precision=bf16", "checkpointing=full",
         "train.seq_len=2048", "train.batch_size=1", "cluster.nproc_per_node=1",
         "cluster.device=cuda", "train.max_steps=12", "train.warmup_steps=2",
         "eval.every_steps=0", "data.num_records=4000"]
# what the peak may differ from the plan by (as tests/gpu/test_gpu_memory.py's model tolerance)
TOLERANCE = 0.10


def _summary(tmp_path, *extra: str) -> dict[str, float]:
    from tests.gpu.test_gpu_run import _run, _run_record

    code, log = _run(tmp_path, *SHAPE, *extra, timeout=1800)
    assert code == 0, log[-4000:]
    client, run = _run_record(tmp_path)
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "loss")]
    return {**run.data.metrics, "first_loss": losses[0], "last_loss": losses[-1]}


def test_8b_lora_dpo_tokens_per_s_and_peak_against_the_plan(tmp_path):
    dpo = _summary(tmp_path / "dpo", "objective=dpo")
    sft = _summary(tmp_path / "sft")
    assert dpo["first_loss"] == pytest.approx(math.log(2), rel=1e-3)  # bf16: ln 2 to rounding
    measured, predicted = dpo["summary/peak_memory_gb"], dpo["summary/predicted_peak_memory_gb"]
    ratio = sft["summary/tokens_per_sec"] / dpo["summary/tokens_per_sec"]
    print(f"8b lora dpo: {dpo['summary/tokens_per_sec']:.0f} tok/s, MFU "
          f"{dpo.get('summary/mfu', 0):.2%}, peak {measured:.2f} GB (plan {predicted:.2f}); "
          f"sft: {sft['summary/tokens_per_sec']:.0f} tok/s, peak "
          f"{sft['summary/peak_memory_gb']:.2f} GB; dpo step time / sft's {ratio:.2f}")
    assert abs(measured / predicted - 1) <= TOLERANCE
    # (the ratio is recorded, not asserted: speed is measured in benchmarks. Both runs step 2048
    # tokens; SFT on one sequence a pair would step half of DPO's: the goal of 2.2 x is
    # this ratio at 1.1)
