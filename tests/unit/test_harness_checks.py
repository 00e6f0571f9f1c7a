"""eval.harness refused before launch (llama_fsdp/harness/): each bad input in one line that
names it and the fix, and nothing left behind; the plan's harness phase; the results' metrics."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llama_fsdp import harness
from llama_fsdp.config.schema import HarnessConfig
from tests.conftest import make_spec


def _cli(cwd: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llama_fsdp", "cluster.device=cpu", *overrides],
                          cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_an_unknown_task_names_the_closest(tmp_path):
    r = _cli(tmp_path, "eval.harness.tasks=[llama_fsdp_synthtic,hellaswg]",
             env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2, r.stderr[-2000:]
    log = r.stdout + r.stderr
    assert ("no lm-eval task 'llama_fsdp_synthtic'; the closest: llama_fsdp_synthetic" in log)
    assert "no lm-eval task 'hellaswg'; the closest: hellaswag" in log
    assert "eval.harness.include_path" in log and "Traceback" not in log
    assert not (tmp_path / "outputs" / "runs").exists()  # refused before a run directory


def test_without_lm_eval_the_run_names_the_extra(tmp_path):
    """lm-eval made unimportable in the command's interpreter (a sitecustomize, as a venv
    without the extra has it): the refusal says which pip extra adds it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['lm_eval'] = None\n")
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    r = _cli(tmp_path, "eval.harness.tasks=[llama_fsdp_synthetic]", env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    log = r.stdout + r.stderr
    assert "needs lm-evaluation-harness, which is not installed: pip install " \
           "'llama_fsdp[eval]'" in log
    assert not (tmp_path / "outputs" / "runs").exists()


def test_a_hub_task_without_the_hub_names_the_task_and_include_path(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    problems = harness.harness_problems(HarnessConfig(tasks=["arc_easy", harness.BUNDLED_TASK]))
    assert len(problems) == 1, problems
    assert "arc_easy (allenai/ai2_arc) read their documents from the Hugging Face hub" in \
           problems[0]
    assert "eval.harness.include_path" in problems[0]
    # the bundled task makes its documents itself: fine offline
    assert harness.harness_problems(HarnessConfig(tasks=[harness.BUNDLED_TASK])) == []


def test_a_local_task_folder_runs_offline(tmp_path, monkeypatch):
    """A task YAML of one's own reading a local JSON file (dataset_path: json) is found through
    include_path and is not a hub task."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "mine.yaml").write_text(
        "task: my_local_task\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{q}}'\n"
        "doc_to_target: '{{a}}'\nmetric_list:\n  - metric: exact_match\n")
    h = HarnessConfig(tasks=["my_local_task"], include_path=str(tmp_path))
    assert harness.harness_problems(h) == []
    h = HarnessConfig(tasks=["my_local_task"], include_path=str(tmp_path / "nowhere"))
    assert "is not a folder" in harness.harness_problems(h)[0]


@pytest.mark.parametrize("key,value,says", [
    ("limit", 0, "eval.harness.limit=0 must be > 0"),
    ("limit", -3, "eval.harness.limit=-3 must be > 0"),
    ("batch_size", 0, "eval.harness.batch_size=0 must be >= 1"),
    ("num_fewshot", -1, "eval.harness.num_fewshot=-1 must be >= 0"),
    ("every_steps", -5, "eval.harness.every_steps=-5 must be >= 0"),
])
def test_bounds(key, value, says):
    problems = harness.harness_problems(HarnessConfig(**{key: value}))
    assert any(says in p for p in problems), problems


def test_the_plan_has_a_harness_phase_and_refuses_what_does_not_fit():
    from llama_fsdp.plan import make_plan
    from llama_fsdp.plan.remedies import fixes_text

    tasks = "eval.harness.tasks=[llama_fsdp_synthetic]"
    small = make_plan(make_spec([tasks]))
    assert "harness" in small.phases and small.fits
    # 70B QLoRA trains on 4 x 24 GB, but its merged export (fp32: 282 GB) cannot be scored on one
    big = make_plan(make_spec(["model=70b", "finetune=qlora", "cluster.nproc_per_node=4",
                               "cluster.device=cuda", "cluster.gpu_type=rtx4090",
                               "checkpointing=full", "train.batch_size=1", "dry_run=true", tasks]))
    assert big.peak_phase == "harness" and not big.fits
    assert big.phases["harness"] > 70e9 * 4  # the whole model in its dtype, at least
    text = fixes_text(big.spec, big)
    assert "the training alone fits" in text and "python -m llama_fsdp.evaluate" in text
    # without the harness the same run fits
    assert make_plan(make_spec(["model=70b", "finetune=qlora", "cluster.nproc_per_node=4",
                                "cluster.device=cuda", "cluster.gpu_type=rtx4090",
                                "checkpointing=full", "train.batch_size=1", "dry_run=true"])).fits


def test_the_harness_turns_on_the_export_it_scores():
    full = make_spec(["model=1b", "eval.harness.tasks=[llama_fsdp_synthetic]"])
    assert full.save.export_hf is True
    assert make_spec(["model=1b"]).save.export_hf is False  # big models: off unless asked
    assert make_spec([]).save.export_hf is True  # the tiny default leaves a model
    lora = make_spec(["finetune=lora", "eval.harness.tasks=[llama_fsdp_synthetic]"])
    assert lora.finetune.export_merged is True and lora.save.export_hf is False


def test_metrics_of_lm_eval_results():
    results = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1,
                                 "acc_norm,none": 0.6, "exact_match,strict": 0.25,
                                 "sample_len": 10}}}
    assert harness.metrics(results) == {"harness/t/acc": 0.5, "harness/t/acc_stderr": 0.1,
                                        "harness/t/acc_norm": 0.6,
                                        "harness/t/exact_match_strict": 0.25}
    assert harness.headline(results) == {"harness/t/acc": 0.5}


def test_a_sweep_with_the_harness_picks_its_best_point_by_the_benchmark():
    from llama_fsdp.tracking.sweep import Best

    assert str(Best.chosen("summary/eval_loss", "min", ["llama_fsdp_synthetic"])) == \
        "highest harness score"
    assert str(Best.chosen("summary/eval_loss", "min", [])) == "lowest summary/eval_loss"
    # a metric the user chose is kept
    assert str(Best.chosen("summary/tokens_per_sec", "max", ["llama_fsdp_synthetic"])) == \
        "highest summary/tokens_per_sec"
