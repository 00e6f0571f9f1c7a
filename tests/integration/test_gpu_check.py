"""The GPU check (scripts/gpu_check.sh, docs/gpu.md) rehearsed on the CPU, so that it cannot
break unseen between GPU sessions.

One run of the documented rehearsal command (module fixture: every stage with tiny shapes, a
wheelhouse of one real wheel carried, one stage given a cap it cannot meet) is checked result by
result: the files the device tool would return, the machine, the default command's numbers,
each GPU test, each throughput runner, the cut stage and the one after it, the landing steps;
then the converter turns the results into benchmarks/gpu.md's section. Besides: the check on a
machine without a GPU, a cut that must find a process that left the stage's session, and the
GPU command lines the planner must let fit one H100.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import docs_commands as docs

# the rehearsal (the module's fixture) took 308 s in a CI run and more than pyproject's 600 s
# beside test_plan_memory's 4 ranks: this is a hang guard, not a speed check
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = docs.REPO
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_check_stages as stages  # noqa: E402
import gpu_report  # noqa: E402

CUT = "adapters-8b"  # the stage whose cap the rehearsal sets to 3 s
CARRIED = "submitit"  # the dependency the rehearsal's wheelhouse carries
FILE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")  # what the device tool returns


def fill(work: Path) -> dict[str, str]:
    return {"python": sys.executable, "work": str(work)}


def repackaged_wheel(dist: str, dest: Path, scratch: Path) -> Path:
    """A wheel of ``dist`` built offline from this environment's installed files: a real
    dependency for the rehearsal to carry."""
    d = md.distribution(dist)
    top = (d.read_text("top_level.txt") or dist).split()[0]
    src = scratch / dist
    shutil.copytree(Path(d.locate_file(top)), src / top,
                    ignore=shutil.ignore_patterns("__pycache__"))
    (src / "pyproject.toml").write_text(
        f'[project]\nname = "{dist}"\nversion = "{d.version}"\n'
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[tool.setuptools.packages.find]\ninclude = ["{top}*"]\n')
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "-w", str(dest), str(src)], check=True,
                   capture_output=True)
    return next(dest.glob(f"{dist}-*.whl"))


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu_check")


@pytest.fixture(scope="module")
def rehearsal(work):
    repackaged_wheel(CARRIED, work / "whl", work / "scratch")
    cmd, env = docs.command("gpu_check_cpu", **fill(work))
    ran = docs.run(cmd, REPO, env, timeout=900)
    out = work / "out"
    assert (out / gpu_report.RESULTS).exists(), str(ran)
    return ran, out, gpu_report.read(out / gpu_report.RESULTS)


def _of(records, kind, **match):
    return [r for r in records if r.get("kind") == kind
            and all(r.get(k) == v for k, v in match.items())]


def _stage_end(records, name):
    (end,) = [r for r in _of(records, "stage", stage=name) if r["status"] != "started"]
    return end


def test_the_rehearsal_returns_each_stage_in_at_most_8_files(rehearsal):
    ran, out, records = rehearsal
    assert ran.returncode == 1, str(ran)  # a stage was cut
    files = sorted(out.iterdir())
    assert len(files) <= gpu_check.MAX_FILES and all(p.is_file() for p in files), files
    assert all(p.stat().st_size < 16 * 2**20 and FILE_NAME.match(p.name) for p in files)
    names = {p.name for p in files}
    assert {gpu_report.RESULTS, gpu_report.SUMMARY} <= names
    for stage in gpu_check.STAGES:
        assert (out / stage.log).stat().st_size > 0, stage.name
    lines = (out / gpu_report.RESULTS).read_text().splitlines()
    assert len(lines) == len(records) and all(json.loads(line) for line in lines)
    # summary.md is the render of every result, rewritten after the last one
    assert (out / gpu_report.SUMMARY).read_text() == gpu_report.render(records)
    status = {s.name: _stage_end(records, s.name)["status"] for s in gpu_check.STAGES}
    assert status == {**{s.name: "done" for s in gpu_check.STAGES}, CUT: "cut"}, status
    assert f"{CUT}: cut after" in ran.output and "landing: done" in ran.output


def test_the_machine_and_the_carried_wheel(rehearsal):
    _, _, records = rehearsal
    (machine,) = _of(records, "machine")
    assert machine["missing"] == {}
    versions = machine["versions"]
    assert {dist for dist, _ in stages.IMPORTS} == set(versions)
    assert versions["torch"] == md.version("torch")
    # the carried wheel was installed, and every stage imported it from there
    assert versions[CARRIED] == f"{md.version(CARRIED)} (carried)"
    assert machine["wheels"].startswith("1 from whl/")
    assert machine["device"] == "CPU (rehearsal)" and machine["command"].startswith("DEVICE=cpu")


def test_the_default_command_reports_loss_speed_mfu_and_memory(rehearsal):
    _, _, records = rehearsal
    (run,) = _of(records, "run", name="default")
    assert run["exit_code"] == 0 and run["status"] == "FINISHED", run
    assert run["command"].startswith("python -m llama_fsdp cluster.device=cpu")
    assert run["steps"] == 3 and run["loss_last"] < run["loss_first"]
    assert run["tokens_per_s"] > 0 and 0 < run["mfu"] < 1
    assert run["peak_allocated_gb"] > 0 and run["predicted_peak_gb"] > 0
    assert run["peak_reserved_gb"] is None  # CUDA's reserved memory: none on the CPU
    assert run["device"] == "cpu (gloo)" and run["attention"] == "varlen"


def test_each_chosen_gpu_test_is_collected_and_reported(rehearsal):
    _, _, records = rehearsal
    tests = _of(records, "test")
    assert [t["name"] for t in tests] == list(stages.GPU_TESTS)
    for t in tests:  # on the CPU each skips, saying why
        assert t["outcome"] == "skipped" and "CUDA" in t["message"], t


def test_throughput_reports_each_runner_with_mfu(rehearsal):
    _, _, records = rehearsal
    rows = _of(records, "throughput")
    assert [r["runner"] for r in rows] == list(stages.SHAPES["cpu"].runners)
    by = {r["runner"]: r for r in rows}
    # llama_fsdp's runs step with the fused AdamW, as on CUDA (gpu_check_stages.SHAPES)
    assert "optim.fused=true" in by[stages.ONE_RECORD]["command"], by[stages.ONE_RECORD]
    # rows like the peers': a data file of long records, one a row (truncated to it)
    one = by[stages.ONE_RECORD]
    assert "data=jsonl" in one["command"] and "one_record.jsonl" in one["command"], one
    assert "rows of one record each" in one["label"], one
    for r in rows:
        assert r["error"] is None and r["steady_steps"] == 3, r
        assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 and r["mfu"] > 0, r
        assert "$RUN" in r["command"]


def test_throughput_profiles_where_each_runners_step_goes(rehearsal):
    """Each runner's steady steps under torch.profiler (benchmarks/step_clock.py): the ops with
    the most self time, sorted, the matmuls among them on the CPU, and the table in the
    summary; the profiled steps still count as steady steps above. (The busy time against the
    step's wall time is the GPU's number: on the CPU the ops of every thread add up.)"""
    _, out, records = rehearsal
    profiles = _of(records, "profile")
    assert [r["runner"] for r in profiles] == list(stages.SHAPES["cpu"].runners)
    for r in profiles:
        assert r["device"] == "cpu" and r["steps"] == 2 and r["total_us"] > 0, r
        times = [op["self_us"] for op in r["ops"]]
        assert times == sorted(times, reverse=True) and len(times) >= 5, r
        # the step's matmuls are in its top ops; where they rank is the machine's load (under
        # the suite's, the optimizer's sqrt, mul and lerp over every parameter outran them)
        assert "aten::mm" in [op["name"] for op in r["ops"]], r["ops"]
    assert "Where the step goes (torch.profiler" in (out / gpu_report.SUMMARY).read_text()


def test_a_stage_over_its_cap_is_cut_and_the_next_starts(rehearsal):
    _, _, records = rehearsal
    start = next(r for r in _of(records, "stage", stage=CUT) if r["status"] == "started")
    end = _stage_end(records, CUT)
    assert end["cap_s"] == 3 and end["exit_code"] is None
    # cut at its cap: SIGTERM, then at most GRACE_S (5 s) before SIGKILL, then the reaping
    assert 3 <= end["elapsed_s"] < 3 + 5 + 10, end
    assert end["running"] == "tiny-qlora"  # what it was doing, from its progress record
    assert gpu_check.token_pids(start["token"]) == []  # nothing it started is left
    assert not _of(records, "run", stage=CUT)
    landing = [r for r in records if r.get("stage") == "landing"]
    assert landing[0]["status"] == "started" and landing[0]["t"] >= end["t"]
    runs = _of(records, "run", stage="landing")
    assert [r["name"] for r in runs] == ["chunked-loss", "dpo-lora", "8b-adamw8bit",
                                         "qlora-65k-24gb"], runs
    assert all(r["status"] == "FINISHED" for r in runs), runs


def test_the_landed_features_run_and_none_is_skipped(rehearsal):
    """The chunked loss (issue 40) and DPO (issue 37) are in this checkout: the landing stage
    runs their command lines (a feature missing from a checkout is skipped with Hydra's
    reason: compose_error)."""
    from benchmarks.gpu_check_stages import compose_error

    _, _, records = rehearsal
    assert not _of(records, "skipped")
    (dpo,) = _of(records, "run", name="dpo-lora")
    assert dpo["command"].startswith("python -m llama_fsdp model=tiny objective=dpo"), dpo
    # its loss curve is read back (MLflow's dpo_loss): LoRA starts at the reference, ln 2
    assert dpo["exit_code"] == 0 and dpo["steps"] >= 1, dpo
    assert abs(dpo["loss_first"] - math.log(2)) < 1e-3, dpo
    assert "objective" in compose_error(["objective=nope"])
    # the 24 GB-capped long-context step: its environment shown, offload and long records
    (capped,) = _of(records, "run", name="qlora-65k-24gb")
    assert capped["command"].startswith("MEMORY_CAP_GB=24 python -m llama_fsdp model=tiny "
                                        "finetune=qlora"), capped
    assert "checkpointing.offload=true" in capped["command"] and "data=jsonl" in capped["command"]


def test_the_converter_appends_the_checks_section(rehearsal, work):
    cmd, env = docs.command("gpu_report", **fill(work))
    ran = docs.run(cmd, REPO, env, timeout=60)
    assert ran.returncode == 0, str(ran)
    text = (work / "gpu.md").read_text()
    assert text.startswith("# GPU measurements\n")
    assert "\n## GPU check: CPU (rehearsal), " in text
    assert f"| {CUT} | cut | 3 |" in text and "cut while running tiny-qlora" in text
    assert re.search(r"^\| default \| FINISHED \| [\d.]+ → [\d.]+ \| [\d,]+ \| [\d.]+% \|", text,
                     re.M), text
    assert "- default: `python -m llama_fsdp cluster.device=cpu" in text
    for label in ("llama_fsdp (sharding=full, rows of one record each, as the peers')",
                  "HF Trainer, FSDP2 requested", "bare FSDP2 loop (floor)"):
        assert re.search(rf"^\| {re.escape(label)} \| .+ \| [\d,]+ \| [\d.]+ \| [\d.]+% \|", text,
                         re.M), label
    assert f"GPU tests: {len(stages.GPU_TESTS)} skipped" in text
    for landed in ("chunked-loss", "dpo-lora", "8b-adamw8bit"):  # each a row of its own
        assert re.search(rf"^\| {landed} \| FINISHED \| ", text, re.M), landed
    again = docs.run(cmd, REPO, env, timeout=60)
    assert again.returncode != 0 and "already has this check's section" in again.output
    assert (work / "gpu.md").read_text() == text


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here")
def test_without_a_gpu_the_check_stops_after_setup(work):
    cmd, env = docs.command("gpu_check", **fill(work))
    ran = docs.run(cmd, REPO, env, timeout=300)
    assert ran.returncode == 1, str(ran)
    records = gpu_report.read(work / "nogpu" / gpu_report.RESULTS)
    assert _stage_end(records, "setup")["status"] == "failed"
    assert "torch sees no GPU" in (work / "nogpu" / "setup.log").read_text()
    for stage in gpu_check.STAGES[1:]:
        end = _stage_end(records, stage.name)
        assert end["status"] == "skipped" and end["reason"].startswith("setup failed"), end
    assert not _of(records, "run")


def test_a_cut_ends_a_process_that_left_the_stage_session(tmp_path):
    """end_stage finds what the process group cannot: a process in a session of its own that
    ignores SIGTERM (as a throughput run in its own session, or a stuck rank, would)."""
    token = "test-" + os.urandom(4).hex()
    pid_file = tmp_path / "escaped.pid"
    proc = subprocess.Popen(
        ["bash", "-c", f"trap '' TERM; setsid bash -c 'echo $$ > {pid_file}; sleep 300' & "
                       "sleep 300"],
        env={**os.environ, gpu_check.TOKEN_ENV: token}, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not (pid_file.exists() and pid_file.read_text().strip()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        escaped = int(pid_file.read_text())
        assert os.getsid(escaped) != os.getsid(proc.pid)  # outside the stage's session
        assert len(gpu_check.token_pids(token)) >= 3  # bash, its sleep, the escaped one
        start = time.monotonic()
        killed = gpu_check.end_stage(proc, token, grace_s=1)
        assert killed >= 2  # SIGTERM was ignored: SIGKILL after the grace
        assert 1 <= time.monotonic() - start < 15
        assert gpu_check.token_pids(token) == [] and proc.returncode is not None
        assert not gpu_check.running(escaped)  # exited (at most a zombie waiting to be reaped)
    finally:  # whatever a failure left behind
        for pid in gpu_check.token_pids(token):
            os.kill(pid, signal.SIGKILL)


def test_a_stopped_check_ends_the_stage_in_progress(work):
    """SIGTERM to the check (the device tool at its timeout, a Ctrl-C) ends the running stage
    and everything it started before the check exits, and the stage's record says so."""
    out = work / "stopped"
    env = docs.user_env({"DEVICE": "cpu", "PY": sys.executable, "OUT": str(out),
                         "WORK": str(work / "stopped-work"), "WHEELS": str(work / "no-wheels"),
                         "STAGES": "default"})
    proc = subprocess.Popen(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    start = None
    try:
        deadline = time.monotonic() + 300
        while True:  # until the default command's launcher and rank run
            records = gpu_report.read(out / gpu_report.RESULTS) if out.exists() else []
            start = next((r for r in _of(records, "stage", stage="default")), None)
            if start and len(gpu_check.token_pids(start["token"])) >= 3:
                break
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # bash exec'd the check: this is its process
        output, _ = proc.communicate(timeout=60)
        left = gpu_check.token_pids(start["token"])
    finally:
        docs.stop(proc)
        for pid in gpu_check.token_pids(start["token"]) if start else []:
            os.kill(pid, signal.SIGKILL)
    assert left == []  # nothing the stage started outlives the check
    assert proc.returncode == 1 and "stopped (SIGTERM)" in output, output[-3000:]
    end = _stage_end(gpu_report.read(out / gpu_report.RESULTS), "default")
    assert end["status"] == "cut" and end["reason"] == "the check was stopped (SIGTERM)", end
    assert end["running"] == "default"


def _gpu_line(name: str) -> list[str]:
    """A command line of the check as it runs on the GPU (gpu_check_stages' tables)."""
    sh = stages.SHAPES["cuda"]
    if name == "throughput":
        return stages.throughput_overrides(sh, "cuda")
    if name in ("8b-qlora", "8b-lora"):
        return [*stages.adapter_overrides(sh, name[3:]), *sh.extra]
    return [*next(s for s in stages.LANDING if s.name == name).overrides(sh), *sh.extra]


@pytest.mark.parametrize("name", ["throughput", "8b-qlora", "8b-lora", "8b-adamw8bit"])
def test_the_gpu_command_lines_plan_to_fit_one_h100(name, tmp_path):
    """What the check runs on the GPU, planned here for one H100: a config the planner would
    refuse there would cost the GPU session a stage."""
    _, plan = stages.plan_of([*_gpu_line(name), "cluster.device=cuda", "cluster.gpu_type=h100",
                              "dry_run=true"], tmp_path)  # (planned for GPUs it need not have)
    assert plan.fits, plan.table()


def test_offline_wheels(work):
    cmd, env = docs.command("offline_wheels", **fill(work))
    parse = subprocess.run(["bash", "-n", "scripts/offline_wheels.sh"], cwd=REPO,
                           capture_output=True, text=True)
    assert parse.returncode == 0, parse.stderr
    if os.environ.get("LLAMA_FSDP_DOCS_INSTALL") != "1":
        pytest.skip("bash scripts/offline_wheels.sh downloads the 57 wheels the GPU check "
                    "carries (39 MiB): run with LLAMA_FSDP_DOCS_INSTALL=1 to run it")
    ran = docs.run(cmd, REPO, env, timeout=900)
    assert ran.returncode == 0, str(ran)
    wheels = sorted((work / "wheelhouse").glob("*.whl"))
    names = {w.name.split("-")[0].lower().replace("_", "-") for w in wheels}
    assert len(names) == len(wheels)  # one wheel per package
    assert {"hydra-core", "omegaconf", "mlflow-skinny", "submitit", "datasets", "torchao"} <= names
    carried = re.search(r"= ([\d.]+) MiB of 64 MiB", ran.output)
    assert carried and float(carried.group(1)) < 64, ran.output[-2000:]
