"""eval.harness refused before launch (llama_fsdp/harness/): each bad input in one line that
names it and the fix, and nothing left behind; the plan's harness phase; the results' metrics."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from llama_fsdp import harness
from llama_fsdp.config.schema import HarnessConfig
from tests.conftest import make_spec
from tests import warm


def _cli(cwd: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([warm.python(), "-m", "llama_fsdp", "cluster.device=cpu", *overrides],
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
    (tmp_path / "docs.jsonl").write_text('{"q": "1+1=", "a": "2"}\n')
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
    # (issue 63: inf failed with an OverflowError after training; 1e9 resamples ran an hour)
    ("limit", float("inf"), "eval.harness.limit=inf must be > 0 and finite"),
    ("limit", float("nan"), "eval.harness.limit=nan must be > 0 and finite"),
    ("bootstrap_iters", 10**9, "eval.harness.bootstrap_iters=1000000000 is above 100000"),
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


def _task_folder(folder: Path, *, data: bool = True, function: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    docs = folder / "docs.jsonl"
    if data:
        docs.write_text('{"q": "1+1=", "a": "2"}\n')
    (folder / "base.yaml").write_text(
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {docs}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_target: '{{a}}'\n"
        "metric_list:\n  - metric: exact_match\n")
    text = "doc_to_text: !function utils.prompt\n" if function else "doc_to_text: '{{q}}'\n"
    (folder / "mine.yaml").write_text(f"task: my_local_task\ninclude: base.yaml\n{text}")
    (folder / "utils.py").write_text(
        f"open({str(folder / 'ran')!r}, 'w').close()\n\ndef prompt(doc):\n    return doc['q']\n")
    return folder


def test_a_local_task_whose_data_file_is_missing_is_refused_naming_it(tmp_path, monkeypatch):
    """(issue 63: a FileNotFoundError after training.) The file is named in the task's include."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = _task_folder(tmp_path / "tasks", data=False)
    problems = harness.harness_problems(HarnessConfig(tasks=["my_local_task"],
                                                      include_path=str(folder)))
    assert len(problems) == 1 and problems[0].startswith(
        f"eval.harness.tasks: my_local_task reads {folder / 'docs.jsonl'}, which does not "
        f"exist (dataset_kwargs.data_files in {folder / 'mine.yaml'})"), problems


def test_a_task_folders_python_runs_only_with_consent(tmp_path, monkeypatch, caplog):
    """(issue 63: `!function utils.x` imported the folder's utils.py without a word.) Refused,
    naming the file, and nothing of it ran while looking; with consent it is named in a
    warning; a folder without !function needs none."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = _task_folder(tmp_path / "tasks", function=True)
    h = HarnessConfig(tasks=["my_local_task"], include_path=str(folder))
    problems = harness.harness_problems(h)
    assert problems == [
        f"eval.harness.include_path={folder}: its task YAMLs ({folder / 'mine.yaml'}) name "
        f"Python with !function, which lm-eval would import and run: {folder / 'utils.py'}. "
        "Read it, then consent with eval.harness.trust_task_code=true, or use task YAMLs "
        "without !function"], problems
    assert not (folder / "ran").exists()
    h = HarnessConfig(tasks=["my_local_task"], include_path=str(folder), trust_task_code=True)
    with caplog.at_level("WARNING", logger="llama_fsdp.harness"):
        assert harness.harness_problems(h) == []
    assert f"lm-eval will run the task folder's Python: {folder / 'utils.py'}" in caplog.text
    assert not (folder / "ran").exists()  # (consent given: it runs when the task loads)
    plain = _task_folder(tmp_path / "plain")
    assert harness.harness_problems(HarnessConfig(tasks=["my_local_task"],
                                                  include_path=str(plain))) == []


def test_evaluate_can_name_its_own_flags_in_the_consent(tmp_path, monkeypatch):
    """The same check for evaluate's --include-path, said with its flags."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = _task_folder(tmp_path / "tasks", function=True)
    (problem,) = harness.harness_problems(
        HarnessConfig(tasks=["my_local_task"], include_path=str(folder)),
        include_key="--include-path", consent="--trust-task-code")
    assert problem.startswith(f"--include-path={folder}: its task YAMLs")
    assert "consent with --trust-task-code, or use" in problem


def test_a_task_templates_jinja_cannot_reach_python(tmp_path, monkeypatch):
    """(issue 63, found while closing it: lm-eval renders a task YAML's templates in a plain
    Jinja environment, so a folder with no !function could still run Python from
    `doc_to_text`.) The task loads through the project's task manager, its template refuses
    to reach Python's internals (SecurityError) and the marker it would write is never made;
    a plain template renders as before."""
    from jinja2.exceptions import SecurityError
    from lm_eval.tasks import get_task_dict

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = _task_folder(tmp_path / "tasks")
    marker = tmp_path / "jinja-ran"
    (folder / "evil.yaml").write_text(
        "task: my_evil_task\ninclude: base.yaml\ndoc_to_text: \"{{ cycler.__init__.__globals__"
        f".os.system('touch {marker}') }}}}{{{{q}}}}\"\n")
    (problem,) = harness.harness_problems(HarnessConfig(tasks=["my_evil_task"],
                                                        include_path=str(folder)))
    assert problem.startswith(  # before launch
        "eval.harness.tasks: my_evil_task's templates reach Python's internals (doc_to_text: "
        f"__globals__, __init__, in {folder / 'evil.yaml'})"), problem
    tm = harness.task_manager(str(folder), ["my_evil_task", "my_local_task"])
    with pytest.raises(SecurityError):  # (lm-eval renders a document's prompt as it loads)
        get_task_dict(["my_evil_task"], tm)
    assert not marker.exists()
    plain = get_task_dict(["my_local_task"], tm)["my_local_task"]
    assert plain.doc_to_text(next(iter(plain.test_docs()))) == "1+1="
