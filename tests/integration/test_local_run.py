"""The README's default command, end to end, in a fresh directory: real ranks, real MLflow."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import docs_commands as docs
from tests import warm

pytestmark = [pytest.mark.slow]

STEP_METRICS = {"loss", "lr", "grad_norm", "tokens_per_sec", "tokens_per_sec_per_device",
                "step_time_s", "peak_memory_gb"}


def _run(cwd: Path, *overrides: str, env_extra: dict | None = None, timeout: int = 600):
    """The real command in a fresh directory, on the CPU (as CI has it)."""
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([warm.python(), "-m", "llama_fsdp", "cluster.device=cpu", *overrides],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _only_run(db: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.get_experiment_by_name("llama_fsdp")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    return client, runs[0]


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """`python -m llama_fsdp` exactly as a user types it, in an empty directory."""
    cwd = tmp_path_factory.mktemp("fresh")
    out = _run(cwd)
    assert out.returncode == 0, out.stderr[-4000:]
    return cwd, out


def test_default_run_trains_and_reports(default_run):
    cwd, out = default_run
    log = out.stdout + out.stderr
    assert "train: 100%" in log  # rank 0's progress bar reached the terminal
    for line in ("status         finished", "steps          60", "final loss", "tokens/s",
                 "median of the steady steps", "peak memory", "mlflow run"):
        assert line in log
    assert (cwd / "outputs" / "mlflow.db").exists()
    assert log.count("[rank1]") == 0  # only rank 0 talks
    run = next((cwd / "outputs" / "runs").glob("*/*"))
    assert not (run / "hang").exists()  # the hang watch leaves nothing when nothing hung


README = Path(__file__).resolve().parents[2] / "README.md"
# the summary lines that are the same on every run of the default command (a given torch build):
# the rest (tokens/s, memory, paths, ids) is the machine's and the moment's
DETERMINISTIC = ("status", "steps", "final loss")


def readme_summary() -> tuple[str, dict[str, str]]:
    """The torch build README.md names for its summary block, and that block's lines."""
    text = README.read_text()
    build = re.search(r"with torch\s+(\S+?)[,)]", text)
    assert build, "README.md names no torch build for its summary block ('with torch X')"
    block = text.split("then a summary like", 1)[1].split("```", 2)[1]
    return build.group(1), {key: docs.summary_value(block, key) for key in DETERMINISTIC}


def test_readme_summary_is_what_the_default_command_prints(default_run):
    """README.md's summary block (status, steps, final and eval loss, exact match) is the
    default command's, so it cannot drift when the code changes."""
    import torch

    build, lines = readme_summary()
    if build != torch.__version__:
        pytest.skip(f"the README's numbers are of torch {build}; this is {torch.__version__}")
    _, out = default_run
    log = out.stdout + out.stderr
    got = {key: docs.summary_value(log, key) for key in DETERMINISTIC}
    assert {k: got[k] for k in ("status", "steps")} == {k: lines[k] for k in ("status", "steps")}
    # The same torch build prints other last digits on CPUs with other fp32 GEMM kernels (their
    # summation order, over 60 steps): 1.2528 / 1.2491 / 0.33 on an AVX2-only EPYC, 1.2439 /
    # 1.2401 / 0.34 on an AVX-512 Xeon (2026-12-03). A change to the run moves them by more.
    want, have = (_numbers(d["final loss"]) for d in (lines, got))
    assert have.keys() == want.keys(), (got, lines)
    for key in ("final loss", "eval loss"):
        assert have[key] == pytest.approx(want[key], rel=0.015), (key, got, lines)
    assert have["exact match"] == pytest.approx(want["exact match"], abs=0.03), (got, lines)


def _numbers(line: str) -> dict[str, float]:
    """'1.2528   eval loss 1.2491   exact match 0.33' -> its three numbers by name."""
    m = re.fullmatch(r"\s*([\d.]+)\s+eval loss\s+([\d.]+)\s+exact match\s+([\d.]+)\s*", line)
    assert m, line
    return dict(zip(("final loss", "eval loss", "exact match"), map(float, m.groups())))


def test_default_run_mlflow_record(default_run):
    cwd, _ = default_run
    client, run = _only_run(cwd / "outputs" / "mlflow.db")
    assert run.info.status == "FINISHED"
    assert STEP_METRICS <= set(run.data.metrics)
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "loss")]
    assert len(losses) == 60
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5  # the loss visibly falls
    from tests.gpu.test_gpu_run import assert_trains

    assert_trains(losses, 60)  # the GPU tests' "trains", on the CPU run
    assert len(client.get_metric_history(run.info.run_id, "tokens_per_sec")) == 60
    # the held-out split: eval loss falls and the task metric (greedy exact match) rises
    ev = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval_loss")}
    em = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval_exact_match")}
    assert sorted(ev) == [0, 20, 40, 60] and ev[60] < ev[20] < ev[0]
    assert em[0] == 0.0 and em[60] > 0.2
    assert run.data.metrics["packing_efficiency"] > 0.9
    assert run.data.metrics["predicted_peak_memory_gb"] > 0
    assert run.data.params["train.batch_size"] == "8"
    assert run.data.params["model.name"] == "tiny"
    assert run.data.params["sharding.strategy"] == "full"
    assert run.data.tags["git_commit"]
    # the auto choices, as this run resolved them (CPU: fp32, and varlen's block-sparse SDPA
    # over the packed records)
    assert (run.data.tags["precision"], run.data.tags["attention"]) == ("fp32", "varlen")
    assert Path(run.data.tags["output_dir"]).is_relative_to(cwd / "outputs" / "runs")
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "config.yaml" in artifacts
    assert not (cwd / "mlruns").exists()  # artifacts stay under outputs/, beside the store
    assert list((cwd / "outputs" / "mlartifacts").rglob("config.yaml"))


def test_a_crashing_rank_ends_the_run_with_its_traceback(tmp_path):
    out = _run(tmp_path, "train.max_steps=20", "eval.every_steps=0",
               "train.callbacks=[tests.faults.hooks:crash]",
               env_extra={"LLAMA_FSDP_TEST_CRASH": "rank=1,step=2"}, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 1
    assert "the first rank to fail:\nrank 1 on" in log
    assert "injected fault on rank 1 after step 2" in log and "Traceback" in log
    _, run = _only_run(tmp_path / "outputs" / "mlflow.db")
    assert run.info.status == "FAILED"


def test_every_rank_process_has_a_title_that_ps_shows(tmp_path):
    """`ps` tells the processes of a run apart: each rank's supervisor and worker is titled
    with its rank, its role and the run (args), and a short name (comm, what top shows)."""
    shot = tmp_path / "ps.txt"
    out = _run(tmp_path, "train.max_steps=2", "train.warmup_steps=1", "eval.every_steps=0",
               "eval.task_prompts=0", "save.every_steps=0", "tracking.enabled=false",
               "train.callbacks=[tests.integration.ps_hook:snapshot]",
               env_extra={"LLAMA_FSDP_TEST_PS": str(shot)}, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    run = next((tmp_path / "outputs" / "runs").glob("*/*")).name
    rows = [line.split("\t") for line in shot.read_text().splitlines()]
    # (this run's: the tests on the other worker run ranks of their own meanwhile)
    titled = {args: comm for comm, args in rows
              if args.startswith("llama_fsdp rank") and args.endswith(f"(run {run})")}
    want = {f"llama_fsdp rank {r}/2 {role} (run {run})": f"lf{r}/2 {role}"[:15]
            for r in (0, 1) for role in ("worker", "supervisor")}
    assert titled == want, shot.read_text()


def test_a_checkout_runs_without_being_installed(tmp_path):
    """The GPU check's situation (scripts/gpu_check.sh): the dependencies installed, the
    checkout only on PYTHONPATH, no install of the package. The config groups and launchers
    (conf/, launchers/ beside the package) are found, by the launcher and by every rank."""
    import site

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # this environment's packages, without its editable install of llama_fsdp (a .pth line
    # adds a folder to sys.path; the .pth files inside it are not read)
    packages = next(Path(p) for p in site.getsitepackages() if "site-packages" in p)
    assert next(packages.glob("__editable__*llama_fsdp*"), None) is not None, "expected an editable install"
    target = next((venv / "lib").glob("python*/site-packages"))
    (target / "deps.pth").write_text(f"{packages}\n")
    python = venv / "bin" / "python"
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    probe = subprocess.run([str(python), "-c", "import importlib.util as u, sys; "
                            "print(u.find_spec('llama_fsdp').origin, any('editable' in "
                            "getattr(f, '__module__', '') for f in sys.meta_path))"],
                           env=env, capture_output=True, text=True, cwd=tmp_path)
    assert probe.stdout.split() == [str(repo / "llama_fsdp" / "__init__.py"), "False"], probe.stderr
    out = subprocess.run([str(python), "-m", "llama_fsdp", "cluster.device=cpu",
                          "train.max_steps=2", "train.warmup_steps=1", "eval.every_steps=0",
                          "eval.task_prompts=0",
                          "save.every_steps=0", "tracking.enabled=false"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "status         finished" in log and "steps          2" in log


def test_the_default_run_leaves_a_model_and_says_how_to_use_it(default_run):
    """The default run exports its model (save.export_hf's default for the tiny model) and ends
    with the two commands of README.md's summary block that evaluate it and talk to it, each
    naming this run's directory; the export loads in transformers."""
    from transformers import AutoModelForCausalLM

    cwd, out = default_run
    log = out.stdout + out.stderr
    text = README.read_text().split("then a summary like", 1)[1].split("```", 2)[1]
    shown_dir = docs.summary_value(text, "run dir")
    run_dir = docs.summary_value(log, "run dir")
    for key in ("evaluate it", "talk to it"):
        assert docs.summary_value(log, key) == docs.summary_value(text, key).replace(
            shown_dir, run_dir), key
    model = AutoModelForCausalLM.from_pretrained(Path(run_dir) / "export")
    assert sum(p.numel() for p in model.parameters()) == 3_410_176  # the tiny Llama, whole
