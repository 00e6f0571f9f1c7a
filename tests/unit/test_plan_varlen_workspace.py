"""CUDA's flash varlen backward allocates an fp32 dq accumulator of (tokens + 128 x sequences)
x heads x head_dim: the plan counts it from the data's records once they are known
(prepare.replan_for_records), and a run it no longer fits is refused before any rank starts."""
from __future__ import annotations

import logging

import pytest

from llama_fsdp.plan import PlanError, make_plan, varlen_backward_bytes, varlen_backward_extra
from llama_fsdp.prepare.job import replan_for_records
from tests import conftest

CUDA = ["cluster.device=cuda", "cluster.nproc_per_node=1", "tracking.enabled=false",
        "dry_run=true"]
# (rank 16: the H200 run's, before the recipe's rank 8 for 8b)
QLORA_8B = ["model=8b", "finetune=qlora", "precision=bf16", "checkpointing=full",
            "train.batch_size=1", "finetune.rank=16", "finetune.alpha=32"]


def _spec(*overrides: str):
    return conftest.make_spec([*CUDA, *overrides], output_dir="/tmp/llama_fsdp_test/varlen_ws")


def test_the_workspace_is_the_h200s_measured_allocation_and_grows_per_record():
    """The H200 run (benchmarks/gpu_runs/20261126-h200-d/memory_probe.json): 8B at 16,384
    tokens in one row of 2,397 synthetic records allocated 5,295,308,800 bytes in one tensor
    in torch's varlen backward."""
    m = _spec(*QLORA_8B, "cluster.gpu_type=h200", "train.seq_len=16384").model
    assert m.attn_implementation == "varlen"
    assert varlen_backward_bytes(m, micro_batch=1, seq_len=16384, device="cuda",
                                 records=2397) == 5_295_308_800
    one = varlen_backward_bytes(m, micro_batch=1, seq_len=16384, device="cuda")
    assert one == (16384 + 128) * 32 * 128 * 4  # one record per row until the data is known
    assert varlen_backward_bytes(m, micro_batch=1, seq_len=16384, device="cpu") == 0
    # what it adds to the layers' backward: less what the layer freed before its attention
    extra = varlen_backward_extra(m, micro_batch=1, seq_len=16384, c=2, device="cuda",
                                  records=2397)
    assert extra == 5_295_308_800 - ((4 * 14336 + 2 * 4096) * 2 + 4 * 4096) * 16384


def test_a_cuda_varlen_plan_counts_the_fullest_micro_batch_once_the_data_is_known(caplog):
    spec = _spec(*QLORA_8B, "cluster.gpu_type=h200", "train.seq_len=16384")
    before = make_plan(spec)
    with caplog.at_level(logging.INFO, logger="llama_fsdp.prepare.job"):
        grown = replan_for_records(spec, {"records_per_row_max": 2397.0})
    assert grown.records_per_micro_batch == 2397  # the fullest row (its padding joins a record)
    after = make_plan(grown)
    assert after.peak_phase == "layers"
    # the H200 measured 17.28 GB: the plan without the records said 13.8, with them 16.8
    assert before.predicted_peak_bytes < 14e9 and 16.5e9 < after.predicted_peak_bytes < 17.3e9
    assert "2397 records in a micro-batch (2397 in the fullest row)" in caplog.text
    # rows of long records: one per row is what the plan had, nothing moves, nothing printed
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llama_fsdp.prepare.job"):
        same = replan_for_records(spec, {"records_per_row_max": 1.0})
    assert make_plan(same).predicted_peak_bytes == before.predicted_peak_bytes
    assert "plan with the data" not in caplog.text


def test_runs_without_flash_varlen_are_left_as_they_are():
    for spec in (_spec(*QLORA_8B, "cluster.gpu_type=h200", "model.attn_implementation=sdpa"),
                 conftest.make_spec(["cluster.device=cpu", "tracking.enabled=false"])):
        assert replan_for_records(spec, {"records_per_row_max": 500.0}) is spec


def test_a_run_the_records_no_longer_fit_is_refused_with_the_fixes():
    """8B QLoRA at 32K on a 24 GB card fits with one record per row; 4,000 short records in
    the row add 9 GB to the backward: refused, with what would fit."""
    spec = _spec(*QLORA_8B, "cluster.gpu_type=rtx4090", "train.seq_len=32768")
    assert make_plan(spec).fits
    with pytest.raises(PlanError) as err:
        replan_for_records(spec, {"records_per_row_max": 4000.0})
    text = str(err.value)
    assert "workspace for up to 4000 records a micro-batch (4000 in the fullest row)" in text
    assert "checkpointing.offload=true" in text and "force=true" in text, text


def test_the_data_reports_its_fullest_row():
    """build_data's stats carry the most records one packed row holds (what the re-plan reads),
    and an unpacked run's is one."""
    import numpy as np

    from llama_fsdp.data import build_data

    for packing in ("true", "false"):
        spec = conftest.make_spec(["tracking.enabled=false", f"data.packing={packing}"])
        data = build_data(spec.data, **spec.data_kwargs(dp_rank=0, announce=False))
        per_row = np.diff(data.train.row_ptr)
        fullest = data.stats["records_per_row_max"]
        assert fullest == float(per_row.max())
        assert (fullest > 5) if packing == "true" else fullest == 1.0
        # the micro-batch of the b fullest rows: at most b x the fullest
        b = spec.train.batch_size
        batch = data.stats["records_per_micro_batch_max"]
        assert batch == float(np.sort(per_row)[-b:].sum()) <= b * fullest
