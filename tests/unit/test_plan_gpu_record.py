"""The planner against what a real GPU measured: every CUDA peak that the GPU check recorded
(benchmarks/gpu_runs/*/results.jsonl, rendered in benchmarks/gpu.md) is predicted within the
issue's 10% by the plan of the same configuration, rebuilt here from the recorded command.

CI has no GPU, so these records are the only CUDA measurements a CPU run can hold the planner
to: a change of the planner that would have mispredicted the H200 fails here. Before the
one-rank rules (plan.phases.alone) and the CUDA workspaces (plan.device.runtime_bytes) the
plan was 1.54x under the default command's peak and 12% over 8B QLoRA's.

Three kinds of records: a command line of llama_fsdp (``run``: its peak allocated, workspaces
included), a GPU test that ran the command line (``test`` with ``tokens_per_s``: the same), and
a GPU test that measured one process's step tensors (``test`` with ``overhead_gb``: the
workspaces made before the measurement or subtracted as its overhead, so the plan less its
runtime term is what it measured)."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from llama_fsdp.plan import make_plan
from llama_fsdp.plan.device import runtime_bytes
from tests import conftest

REPO = Path(__file__).resolve().parents[2]
RECORDS = sorted((REPO / "benchmarks" / "gpu_runs").glob("*/results.jsonl"))
TOLERANCE = 0.10  # issue 42: CUDA peak within 10% of the plan
# the recorded commands' machine-specific paths, and what stands in for the GPU here
MACHINE = ("output_dir=", "tracking.uri=", "cache_dir=", "data.tokenizer=", "hydra.")
HERE = ["cluster.device=cuda", "cluster.nproc_per_node=1", "tracking.enabled=false",
        "dry_run=true", "cluster.gpu_type=h200"]
# the GPU tests whose records carry a peak, and the overrides they ran with
# (tests/gpu/test_gpu_run.py's SHORT and OPTIONS; tests/gpu/test_gpu_memory.py's _spec)
RUN_SHORT = ["train.max_steps=12", "train.warmup_steps=2", "eval.every_steps=6",
             "eval.task_prompts=8"]
RUN_OPTIONS = {"full-bf16": ["sharding=full", "precision=bf16"],
               "compile": ["train.compile=true"]}


def _memory_test_overrides(name: str) -> list[str]:
    # test_cuda_peak_is_within_tolerance_of_the_plan[full-mixed-none-4]
    strategy, precision, ac, batch = name.split("[")[1].rstrip("]").split("-")
    return ["model=1b", "model.num_layers=4", f"sharding={strategy}", f"precision={precision}",
            f"checkpointing={ac}", f"train.batch_size={batch}", "train.seq_len=2048",
            "data.packing=false", "train.loss=full"]


def _cases() -> list[tuple[str, list[str], float, float, bool]]:
    """(id, overrides, measured GB, the plan GB recorded then, whether workspaces count)."""
    out = []
    for path in RECORDS:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            where = f"{path.parent.name}:{r.get('name')}"
            if r.get("kind") == "run" and r.get("peak_allocated_gb"):
                words = shlex.split(r["command"])
                words = words[words.index("llama_fsdp") + 1:]
                out.append((where, [w for w in words if not w.startswith(MACHINE)],
                            r["peak_allocated_gb"], r["predicted_peak_gb"], True))
            elif r.get("kind") == "test" and r.get("outcome") == "passed" and r.get("props"):
                props, name = r["props"], r["name"]
                if "test_each_option_trains_on_gpus" in name:
                    option = name.split("[")[1].rstrip("]")
                    if option in RUN_OPTIONS:
                        out.append((where, RUN_SHORT + RUN_OPTIONS[option],
                                    props["measured_gb"], props["predicted_gb"], True))
                elif "test_cuda_peak_is_within_tolerance_of_the_plan" in name:
                    out.append((where, _memory_test_overrides(name), props["measured_gb"],
                                props["predicted_gb"], False))
    return out


CASES = _cases()


def test_the_gpu_records_are_there():
    """The records this module checks exist and hold each kind (a glob that found nothing
    would leave the test below with no cases)."""
    assert RECORDS, "benchmarks/gpu_runs/*/results.jsonl: no GPU check recorded"
    assert {c[4] for c in CASES} == {True, False}
    names = " ".join(c[0] for c in CASES)
    assert "8b-qlora" in names and "8b-lora" in names and ":default" in names


@pytest.fixture(scope="module")
def project_tokenizer(tmp_path_factory):
    """The synthetic task's tokenizer as a directory: what the GPU check names as data.tokenizer
    (benchmarks/gpu_check_stages.py: tokenizer_overrides)."""
    from llama_fsdp.config.schema import DataConfig
    from llama_fsdp.data import build_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    build_tokenizer(DataConfig(), conftest.REPO / "outputs" / "cache").save_pretrained(str(path))
    return path


@pytest.mark.parametrize("where,overrides,measured_gb,recorded_plan_gb,with_runtime", CASES,
                         ids=[c[0] for c in CASES])
def test_plan_predicts_the_recorded_cuda_peak(where, overrides, measured_gb, recorded_plan_gb,
                                              with_runtime, project_tokenizer):
    """Each record against this commit's plan, with the data the run had: a flash varlen run's
    plan counts its fullest micro-batch's records once the data is built, as a launch does
    (prepare.replan_for_records)."""
    from llama_fsdp.data import build_data
    from llama_fsdp.plan import flash_varlen_runs
    from llama_fsdp.prepare.job import replan_for_records

    tok = [f"data.tokenizer={project_tokenizer}"] if "model=tiny" not in overrides else []
    spec = conftest.make_spec(overrides + HERE + tok,
                              output_dir="/tmp/llama_fsdp_test/gpu_record")
    if flash_varlen_runs(spec.model, spec.device):
        data = build_data(spec.data, **spec.data_kwargs(dp_rank=0, announce=False))
        spec = replan_for_records(spec, data.stats)
        assert spec.records_per_micro_batch >= spec.train.batch_size
    plan = make_plan(spec)
    predicted = plan.predicted_peak_bytes - (0 if with_runtime else runtime_bytes(spec))
    ratio = measured_gb * 1e9 / predicted
    assert abs(ratio - 1) <= TOLERANCE, (
        f"{where}: the H200 measured {measured_gb:.3f} GB, the plan now says "
        f"{predicted / 1e9:.3f} GB (x{ratio:.3f}; the plan then said {recorded_plan_gb:.3f}); "
        f"phases {', '.join(f'{k} {v / 1e9:.3f}' for k, v in plan.phases.items())}")
