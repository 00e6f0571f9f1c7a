"""The planner against what a real GPU measured, in two parts.

**A regression pin** (``test_the_plan_still_predicts_the_records_it_was_tuned_on``): every
CUDA peak of the GPU sessions in TUNED_ON (benchmarks/gpu_runs/<session>/results.jsonl,
rendered in benchmarks/gpu.md) is predicted within the issue's 10% by this commit's plan of the
same configuration, rebuilt here from the recorded command. The planner's rules were fitted to
these records (the one-rank rules, plan.phases.alone, and the CUDA workspaces,
plan.device.runtime_bytes: before them the plan was 1.54x under the default command's peak and
12% over 8B QLoRA's), so this pin says that a later change of the planner keeps what was
fitted, not that the planner predicts a GPU it has not seen.

**The prediction** (``test_a_new_session_s_peaks_are_within_the_plan_made_before_it``): every
record of a session not in TUNED_ON is held to the plan as it was made before that session:
the plan the run or test itself recorded beside its measurement (``predicted_peak_gb``,
``props.predicted_gb``), which no tuning on that session's numbers can have moved. A session
joins TUNED_ON only in the commit that fits the planner to it, which names itself there.
While every session is in TUNED_ON the test skips, saying so.

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
GPU_RUNS = REPO / "benchmarks" / "gpu_runs"
RECORDS = sorted(GPU_RUNS.glob("*/results.jsonl"))
# the GPU sessions the planner was fitted to, and the commit that fitted it
TUNED_ON = {
    "20261126-h200-a": "9885ba5 (plan.phases.alone, the CUDA workspaces)",
    "20261126-h200-b": "9885ba5 (plan.phases.alone, the CUDA workspaces)",
    "20261126-h200-c": "42de024 (flash varlen's backward workspace)",
    "20261126-h200-d": "42de024 (flash varlen's backward workspace)",
}
TOLERANCE = 0.10  # issue 42: CUDA peak within 10% of the plan
# Peaks of a new session that the plan made before it misses, found and not yet fitted: each
# stays listed until the planner is fitted to its session (which then joins TUNED_ON). The test
# holds the list exact: a miss that goes away, or a new one, fails it.
KNOWN_MISSES = {
    "20261204-h200-b:qlora-65k-24gb": "8B QLoRA at 65,536 tokens with checkpointing.offload: "
    "23.70 GB allocated, the plan 20.27 (x1.169), the first CUDA run of offloaded activations; "
    "not yet explained (benchmarks/gpu.md, the third session)",
}
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


def _cases(records: list[Path]) -> list[tuple[str, list[str], float, float, bool]]:
    """(id, overrides, measured GB, the plan GB recorded then, whether workspaces count)."""
    out = []
    for path in records:
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


CASES = _cases([r for r in RECORDS if r.parent.name in TUNED_ON])
NEW_CASES = _cases([r for r in RECORDS if r.parent.name not in TUNED_ON])


def outside_the_recorded_plan(cases) -> list[str]:
    """The records whose peak is not within TOLERANCE of the plan recorded beside it."""
    return [f"{where}: measured {measured:.3f} GB, the plan then {plan:.3f} GB "
            f"(x{measured / plan:.3f})"
            for where, _, measured, plan, _ in cases if abs(measured / plan - 1) > TOLERANCE]


# the skip below, until a GPU session the planner was not fitted to is recorded (tests/
# conftest.py allows it under CI: the records come from a lent GPU, which CI has not got)
NO_NEW_SESSION = "no GPU session since the planner was fitted"


def test_a_new_session_s_peaks_are_within_the_plan_made_before_it():
    """Each peak of a session the planner was not fitted to, against the plan that run
    recorded. With no such session it has nothing to hold, and says so (a pass would claim a
    prediction nothing tested)."""
    if not NEW_CASES:
        pytest.skip(f"{NO_NEW_SESSION}: every session in benchmarks/gpu_runs is in TUNED_ON "
                    f"({', '.join(sorted(TUNED_ON))})")
    missed = {line.split(": measured")[0] for line in outside_the_recorded_plan(NEW_CASES)}
    assert missed == set(KNOWN_MISSES), (outside_the_recorded_plan(NEW_CASES), KNOWN_MISSES)


def test_a_new_session_is_held_to_its_recorded_plan(tmp_path):
    """Positive control: a made-up session with one peak 12% over the plan it recorded, and
    one 5% under, is found out by the rule above (the first), and the second passes."""
    session = tmp_path / "20990101-h200-z"
    session.mkdir()
    lines = [{"kind": "run", "name": "over", "command": "python -m llama_fsdp model=1b",
              "peak_allocated_gb": 11.2, "predicted_peak_gb": 10.0},
             {"kind": "run", "name": "under", "command": "python -m llama_fsdp model=1b",
              "peak_allocated_gb": 9.5, "predicted_peak_gb": 10.0}]
    (session / "results.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    cases = _cases([session / "results.jsonl"])
    assert [c[0] for c in cases] == ["20990101-h200-z:over", "20990101-h200-z:under"]
    assert outside_the_recorded_plan(cases) == [
        "20990101-h200-z:over: measured 11.200 GB, the plan then 10.000 GB (x1.120)"]


def test_the_gpu_records_are_there():
    """The records this module checks exist and hold each kind (a glob that found nothing
    would leave the test below with no cases)."""
    assert RECORDS, "benchmarks/gpu_runs/*/results.jsonl: no GPU check recorded"
    sessions = {d.name for d in GPU_RUNS.iterdir() if d.is_dir()}
    assert set(TUNED_ON) <= sessions, "TUNED_ON names a missing session"
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
def test_the_plan_still_predicts_the_records_it_was_tuned_on(
        where, overrides, measured_gb, recorded_plan_gb, with_runtime, project_tokenizer):
    """The regression pin: each record of TUNED_ON against this commit's plan, with the data
    the run had: a flash varlen run's plan counts its fullest micro-batch's records once the
    data is built, as a launch does (prepare.replan_for_records)."""
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
