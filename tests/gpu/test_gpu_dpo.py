"""GPU: objective=dpo with LoRA on Llama 3.1 8B's shape (seeded weights: no download), one GPU,
bf16, every layer checkpointed, rows of 2048 tokens of packed synthetic pairs, through the
command users type. Tokens/s and the peak (MLflow's summary, torch.cuda.max_memory_allocated)
against the plan, and SFT with LoRA on the same shape beside it: DPO's step time per token
over SFT's, printed and bounded; and that DPO trains (its first loss ln 2, the policy moved
off the reference after it).

Skipped without CUDA; run with `pytest -m gpu tests/gpu/test_gpu_dpo.py`.
"""
from __future__ import annotations

import math

import pytest

from llama_fsdp.config.metrics import DPO_LOGGED_AS

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPE = ["model=8b", "finetune=lora", "precision=bf16", "checkpointing=full",
         "train.seq_len=2048", "train.batch_size=1", "cluster.nproc_per_node=1",
         "cluster.device=cuda", "train.max_steps=12", "train.warmup_steps=2",
         "eval.every_steps=0", "data.num_records=4000"]
# what the peak may differ from the plan by (as tests/gpu/test_gpu_memory.py's model tolerance)
TOLERANCE = 0.10
STEPS, TOKENS = 12, 2048  # train.max_steps; a step's tokens (one row of train.seq_len)
# DPO's step time per token over SFT's on the same shape: DPO adds the reference's forward (the
# base, adapters off, no backward) to the policy's forward, recomputation and backward: more
# than SFT's, less than twice (benchmarks/dpo_cpu.md: 1.34 on the CPU)
DPO_OVER_SFT = (1.0, 2.0)


def _summary(tmp_path, *extra: str) -> dict:
    """The run's MLflow metrics, and per logged step ("steps": {step: {name: value}}) the
    numbers the test reads."""
    from tests.gpu.test_gpu_run import _run, _run_record

    tmp_path.mkdir(parents=True, exist_ok=True)  # the run's working directory (dpo/, sft/)
    code, log = _run(tmp_path, *SHAPE, *extra, timeout=1800)
    assert code == 0, log[-4000:]
    client, run = _run_record(tmp_path)
    steps: dict[int, dict[str, float]] = {}
    for key in ("loss", "grad_norm", "tokens_per_sec", "step_time_s", "rewards/chosen",
                "rewards/rejected", "rewards/margin", "rewards/accuracy"):
        # (DPO's loss is dpo_loss in MLflow: config/metrics.py's DPO_LOGGED_AS)
        for m in client.get_metric_history(run.info.run_id, DPO_LOGGED_AS.get(key, key)):
            steps.setdefault(m.step, {})[key] = m.value
    return {**run.data.metrics, "steps": steps}


def _assert_tokens_per_s(run: dict, name: str) -> float:
    """Each step's tokens/s is the step's 2048 tokens over its time, and the summary is the
    steady steps' median of them; returns it."""
    steps = run["steps"]
    assert sorted(steps) == list(range(1, STEPS + 1)), (name, sorted(steps))
    for step, m in steps.items():
        assert m["tokens_per_sec"] > 0, (name, step, m)
        assert m["tokens_per_sec"] * m["step_time_s"] == pytest.approx(TOKENS, rel=1e-6), (
            name, step, m)
    tps = run["summary/tokens_per_sec"]
    logged = sorted(m["tokens_per_sec"] for m in steps.values())
    assert logged[0] <= tps <= logged[-1], (name, tps, logged)
    return tps


def test_8b_lora_dpo_tokens_per_s_and_peak_against_the_plan(tmp_path):
    dpo = _summary(tmp_path / "dpo", "objective=dpo")
    sft = _summary(tmp_path / "sft")
    # tokens/s: what each run says it is, and DPO's against SFT's on the same tokens
    dpo_tps, sft_tps = _assert_tokens_per_s(dpo, "dpo"), _assert_tokens_per_s(sft, "sft")
    ratio = sft_tps / dpo_tps
    measured, predicted = dpo["summary/peak_memory_gb"], dpo["summary/predicted_peak_memory_gb"]
    print(f"8b lora dpo: {dpo_tps:.0f} tok/s, MFU {dpo.get('summary/mfu', 0):.2%}, peak "
          f"{measured:.2f} GB (plan {predicted:.2f}); sft: {sft_tps:.0f} tok/s, peak "
          f"{sft['summary/peak_memory_gb']:.2f} GB; dpo step time / sft's {ratio:.2f}")
    assert DPO_OVER_SFT[0] <= ratio <= DPO_OVER_SFT[1], ratio
    # the peak against the plan
    assert abs(measured / predicted - 1) <= TOLERANCE
    # DPO trains: the first step's loss is ln 2 with zero rewards (the policy is the
    # reference), every step has a finite loss and a gradient, and from the second step on
    # the adapters have moved the policy off the reference (rewards not zero)
    steps = dpo["steps"]
    first = steps[1]
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-3)  # bf16: ln 2 to rounding
    assert first["rewards/margin"] == pytest.approx(0, abs=1e-3), first
    for step, m in steps.items():
        assert math.isfinite(m["loss"]) and 0 < m["grad_norm"] < math.inf, (step, m)
        if step > 1:
            assert m["rewards/chosen"] != 0 and m["rewards/rejected"] != 0, (step, m)
            assert m["rewards/margin"] == pytest.approx(
                m["rewards/chosen"] - m["rewards/rejected"], rel=1e-3, abs=1e-6), (step, m)
    assert dpo["summary/reward_accuracy"] == steps[STEPS]["rewards/accuracy"]
    # (that 12 steps from seeded weights generalize is not asserted: the CPU runs of
    # tests/multirank/test_dpo.py hold DPO to held-out accuracy; on this shape a 6-step run's
    # loss went 0.693 -> 0.874, benchmarks/gpu.md)
