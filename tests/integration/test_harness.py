"""eval.harness, python -m llama_fsdp.evaluate and python -m llama_fsdp.generate (docs/evaluate.md),
end to end: real ranks train the default run, lm-eval scores it in the run, and lm-eval's own
command scores the export the same (lm-eval is its own oracle)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests import docs_commands as docs
from tests import warm

pytestmark = [pytest.mark.slow]

TASK, MC = "llama_fsdp_synthetic", "llama_fsdp_synthetic_mc"
EM = f"harness/{TASK}/exact_match"
LIMIT = 100  # what the run's entry appends (docs_commands.py: harness_run)


def run_doc(id: str, cwd: Path, *, timeout: float = 900, **more: str) -> docs.Ran:
    cmd, env = docs.command(id, work=str(cwd), **more)
    return docs.run(cmd, cwd, env, timeout=timeout)


def client(cwd: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{cwd}/outputs/mlflow.db")


@pytest.fixture(scope="session")
def harness_run(tmp_path_factory):
    """README.md's and docs/evaluate.md's run: the default run scored at steps 30 and 60."""
    cwd = tmp_path_factory.mktemp("harness")
    r = run_doc("harness_run", cwd)
    assert r.returncode == 0, str(r)
    run_dir = Path(docs.summary_value(r.output, "run dir"))
    run_id = docs.summary_value(r.output, "mlflow run").split()[0]
    return cwd, r, run_dir, run_id


def _history(cwd: Path, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client(cwd).get_metric_history(run_id, key)}


def test_the_run_scores_itself_with_lm_eval(harness_run):
    cwd, r, run_dir, run_id = harness_run
    scores = _history(cwd, run_id, EM)
    assert sorted(scores) == [30, 60], scores  # every_steps=30 and the end, each once
    assert scores[60] > scores[30], scores  # it got better
    assert scores[60] > 0.1, scores
    # the printed line, as docs/evaluate.md shows it (the number aside), is the MLflow metric
    printed = float(re.search(rf"^  harness\s+{TASK}/exact_match ([\d.]+) \(lm-eval; ",
                              r.output, re.M).group(1))
    assert printed == pytest.approx(scores[60], abs=5e-5)
    shown = docs_states_block()
    for line in shown.splitlines():
        pattern = re.escape(line).replace(re.escape("<run dir>"), re.escape(str(run_dir)))
        pattern = re.sub(r"0\\\.3300", r"[\\d.]+", pattern)
        assert re.search("^" + pattern + "$", r.output, re.M), line
    # lm-eval's results JSON, in the run and in MLflow, for each step
    for step in (30, 60):
        results = json.loads((run_dir / "harness" / f"step_{step:06d}" / "results.json").read_text())
        assert results["results"][TASK]["exact_match,none"] == pytest.approx(scores[step])
        assert results["n-samples"][TASK]["effective"] == LIMIT
        art = client(cwd).download_artifacts(run_id, f"harness/step_{step:06d}/results.json",
                                             str(cwd / f"art{step}"))
        assert json.loads(Path(art).read_text())["results"] == results["results"]
    assert not (run_dir / "harness" / "step_000030" / "model").exists()  # scored, then removed
    run = client(cwd).get_run(run_id)
    assert run.data.metrics["harness score"] == pytest.approx(scores[60], rel=1e-3)
    assert f"{EM}_stderr" in run.data.metrics


def docs_states_block() -> str:
    text = (docs.REPO / "docs" / "evaluate.md").read_text()
    return re.search(r"```\n(  harness .*?)\n```", text, re.S).group(1)


def test_lm_eval_on_the_export_scores_what_the_run_did(harness_run):
    """The oracle: `lm_eval --model hf` on the run's export, same task and limit."""
    cwd, _, run_dir, run_id = harness_run
    r = run_doc("lm_eval_cli", cwd, run_dir=str(run_dir))
    assert r.returncode == 0, str(r)
    row = re.search(rf"\|{TASK}\s*\|\s*1\|none\s*\|\s*0\|exact_match\|↑\s*\|\s*([\d.]+)\|±\s*\|\s*"
                    r"([\d.]+)\|", r.output)
    assert row, r.output[-3000:]
    ours = _history(cwd, run_id, EM)[60]
    assert float(row.group(1)) == pytest.approx(ours, abs=5e-5)  # lm-eval prints 4 digits
    assert float(row.group(2)) == pytest.approx(_history(cwd, run_id, f"{EM}_stderr")[60],
                                                abs=5e-5)


# A task of the test's own (not the project's YAML): its documents a JSON file read by
# datasets' json builder, its prompt and target fields named otherwise, exact match ignoring
# case; held-out records of the synthetic task (another stream than the bundled task's), so
# that the trained model gets some right
OWN_TASK = "task_written_by_the_test"
OWN_YAML = """\
task: task_written_by_the_test
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}} ="
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
generation_kwargs:
  until: ["\\n"]
  do_sample: false
  max_gen_toks: 16
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    regexes_to_ignore: ["^\\\\s+", "\\\\s+$"]
metadata:
  version: 2.0
"""
OWN_DOCS = 40


def test_a_task_written_here_scores_in_the_run_as_lm_eval_s_hf_model_does(harness_run,
                                                                          tmp_path):
    """The run's scorer (what eval.harness runs on rank 0: llama_fsdp.harness.evaluate) on a
    task YAML this test writes, against lm-eval's own "hf" model (what `lm_eval --model hf`
    builds) on the same export, task and folder: a task that is not the project's scores
    alike, so what the two agree on is not the project's YAML."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from llama_fsdp import harness
    from llama_fsdp.config.schema import HarnessConfig
    from llama_fsdp.data.synthetic import synthetic_records

    _, _, run_dir, _ = harness_run
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    docs = tasks / "docs.jsonl"
    docs.write_text("".join(json.dumps({"question": f"{r['instruction']} {r['input']}",
                                        "answer": r["output"]}) + "\n"
                            for r in synthetic_records(OWN_DOCS, seed=1, split="harness")))
    (tasks / "own.yaml").write_text(OWN_YAML.format(docs=docs))
    ours = harness.evaluate(run_dir / "export", HarnessConfig(tasks=[OWN_TASK],
                                                              include_path=str(tasks)),
                            device="cpu")
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={run_dir / 'export'},add_bos_token=True",
        tasks=[OWN_TASK], task_manager=TaskManager(include_path=str(tasks),
                                                   include_defaults=False),
        device="cpu", batch_size=8)
    assert ours["n-samples"][OWN_TASK]["effective"] == OWN_DOCS
    assert theirs["n-samples"][OWN_TASK]["effective"] == OWN_DOCS
    got, want = ours["results"][OWN_TASK], theirs["results"][OWN_TASK]
    assert got["exact_match,none"] == want["exact_match,none"], (got, want)
    assert got["exact_match_stderr,none"] == pytest.approx(want["exact_match_stderr,none"])
    assert 0 < got["exact_match,none"] < 1, got  # it answers some, not all: the score can move
    found = harness.metrics(ours)  # what the run logs to MLflow
    assert found[f"harness/{OWN_TASK}/exact_match"] == got["exact_match,none"]


def test_evaluate_a_checkpoint_scores_as_the_run_did(harness_run):
    """Checkpoint step 30 through convert scores what the run's own export at step 30 did."""
    cwd, _, run_dir, run_id = harness_run
    r = run_doc("evaluate_step", cwd, run_dir=str(run_dir))
    assert r.returncode == 0, str(r)
    score = float(re.search(rf"^harness\s+{TASK}/exact_match ([\d.]+)", r.output, re.M).group(1))
    assert score == pytest.approx(_history(cwd, run_id, EM)[30], abs=5e-5)
    assert "not logged again" in r.output
    assert len(client(cwd).get_metric_history(run_id, EM)) == 2  # still once per step
    assert (run_dir / "harness" / "step_000030" / "results-1.json").is_file()  # beside the run's


def test_evaluate_logs_into_the_run(harness_run):
    cwd, _, run_dir, run_id = harness_run
    own = (run_dir / "harness" / "step_000060" / "results.json").read_bytes()
    r = run_doc("evaluate_run", cwd, run_dir=str(run_dir))
    assert r.returncode == 0, str(r)
    acc = _history(cwd, run_id, f"harness/{MC}/acc")
    assert list(acc) == [60] and 0.5 < acc[60] <= 1.0, acc  # above chance (two choices)
    assert f"harness        {MC}/acc {acc[60]:.4f}" in r.output
    assert (run_dir / "harness" / "step_000060" / "results.json").read_bytes() == own
    extra = json.loads((run_dir / "harness" / "step_000060" / "results-1.json").read_text())
    assert extra["results"][MC]["acc,none"] == pytest.approx(acc[60])


def test_generate_answers_what_lm_eval_scored(harness_run):
    """The generate command's greedy answers to the task's documents score what lm-eval's
    exact match did (same model, format and decoding), and each answer stops at EOS."""
    from llama_fsdp.data.synthetic import synthetic_records
    from llama_fsdp.harness import load_model
    from llama_fsdp.harness.generate_cmd import answer, prompt_ids, run_data_config

    cwd, _, run_dir, run_id = harness_run
    r = run_doc("generate", cwd, run_dir=str(run_dir))
    assert r.returncode == 0, str(r)
    answers = [line for line in r.output.splitlines() if not line.startswith("[")
               and "Loading weights" not in line and line.strip()]
    assert len(answers) == 2, r.output
    stdin = run_doc("generate_stdin", cwd, run_dir=str(run_dir))
    assert stdin.returncode == 0, str(stdin)
    assert answers[1] in stdin.output.splitlines()  # "Next c" either way

    model, tok = load_model(run_dir / "export", device="cpu")
    data = run_data_config(run_dir)
    right, stopped = 0, 0
    records = synthetic_records(200, seed=0, split="harness")[:LIMIT]
    for rec in records:
        ids = prompt_ids(f"{rec['instruction']} {rec['input']}", [], fmt="instruction", tok=tok,
                         data=data)
        out, ended = answer(model, tok, ids, max_new_tokens=16, sample=False, temperature=1.0,
                            top_p=1.0, seed=0)
        right += out == rec["output"]
        stopped += ended
    assert right / LIMIT == pytest.approx(_history(cwd, run_id, EM)[60], abs=1e-9)
    assert right > 0 and stopped == LIMIT  # every answer ended at the end-of-turn token
    # the CLI printed the same greedy answer for "Next c"
    ids = prompt_ids("Next c", [], fmt="instruction", tok=tok, data=data)
    assert answer(model, tok, ids, max_new_tokens=64, sample=False, temperature=1.0, top_p=1.0,
                  seed=0)[0] == answers[1]


def _summary_rows(output: str) -> tuple[list[str], list[list[str]]]:
    """The sweep summary's header and rows: every line between the rule under the header and
    the best point's line."""
    lines = output.split(" summary:\n", 1)[1].splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("best point: "))
    assert set(lines[1].split()) == {"-" * len(w) for w in lines[1].split()}, lines[1]
    return lines[0].split(), [line.split() for line in lines[2:end]]


def test_a_sweep_has_a_harness_column_per_point(tmp_path):
    r = run_doc("harness_sweep", tmp_path)
    assert r.returncode == 0, str(r)
    header, rows = _summary_rows(r.output)
    method, col = header.index("finetune.method"), header.index(f"harness/{MC}/acc")
    scores = {row[method]: float(row[col]) for row in rows}
    assert len(rows) == 3 and sorted(scores) == ["full", "lora", "qlora"], rows
    assert all(0 <= v <= 1 for v in scores.values()), rows
    c = client(tmp_path)
    ids = re.findall(r"^\s+mlflow run\s+(\w+)", r.output, re.M)
    runs = {run.data.params["finetune.method"]: run for run in map(c.get_run, ids)}
    assert sorted(runs) == ["full", "lora", "qlora"]
    for name, run in runs.items():  # each row is its point's run
        assert float(f"{run.data.metrics[f'harness/{MC}/acc']:.4g}") == scores[name], name
        if name != "full":  # the merged model was what scored
            assert (Path(run.data.tags["output_dir"]) / "export_merged" / "config.json").is_file()
    # the best point: the row with the highest harness score (the benchmark, not the eval
    # loss); of equals, the first by name
    top = max(scores.values())
    want = min(runs[name].info.run_name for name, v in scores.items() if v == top)
    best = re.search(r"best point: (.+?) \(highest harness score: ([\d.]+)\)", r.output)
    assert best and best.group(1) == want, (r.output[-2000:], scores)
    assert float(best.group(2)) == pytest.approx(top, abs=1e-3)


def test_hub_tasks_without_the_hub_are_refused(tmp_path):
    r = run_doc("harness_hub", tmp_path, timeout=300)
    assert r.returncode == 2, str(r)
    line = next(l for l in r.output.splitlines() if "read their documents from the Hugging Face"
                in l)
    for name in ("hellaswag (Rowan/hellaswag)", "arc_easy (allenai/ai2_arc)", "mmlu_",
                 "eval.harness.include_path", "llama_fsdp_synthetic is bundled"):
        assert name in line, line
    assert "Traceback" not in r.output
    assert not (tmp_path / "outputs" / "runs").exists()


def test_generate_merges_a_lora_adapter_on_the_fly(harness_run, tmp_path):
    """LoRA trained on the harness run's export as its base (model.path): its run keeps the PEFT
    adapter (export/) and, asked for, the merged model (export_merged/). The adapter merged on
    the fly (harness/models.py) is that merged model: same logits, same greedy answers."""
    import subprocess
    import sys

    import torch

    from llama_fsdp.harness import load_model
    from llama_fsdp.harness.models import resolve

    _, _, base_run, _ = harness_run
    r = subprocess.run([warm.python(), "-m", "llama_fsdp", "cluster.device=cpu",
                        "finetune=lora", f"model.path={base_run / 'export'}",
                        "finetune.export_merged=true", "train.max_steps=4",
                        "train.warmup_steps=0", "eval.every_steps=0", "eval.task_prompts=0",
                        "train.lr=0.01", "tracking.enabled=false"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    run_dir = Path(docs.summary_value(r.stdout + r.stderr, "run dir"))
    adapter = run_dir / "export"
    assert (adapter / "adapter_config.json").is_file()
    with resolve(adapter) as found:  # the adapter alone: merged onto its base on the fly
        assert "merged onto" in found.what
        merged, tok = load_model(found.hf_dir, device="cpu")
        ids = torch.tensor([tok("Next c =")["input_ids"]])
        fly = merged(ids).logits
    reference, _ = load_model(run_dir / "export_merged", device="cpu")
    torch.testing.assert_close(fly, reference(ids).logits, rtol=1e-4, atol=1e-4)
    base, _ = load_model(base_run / "export", device="cpu")
    assert not torch.allclose(base(ids).logits, fly, atol=1e-3)  # the adapters changed it
