"""What each stage of the GPU check does (benchmarks/gpu_check.py runs each in a process of its
own, under its time cap). Every result is appended the moment it is known, and each step first
appends a ``progress`` record, so a cut stage says what it was doing.

The shapes are one table per device: on CUDA the issue's (1b at seq 2048, 8B at seq 2048 on one
GPU, random init: no weights can be downloaded there); on the CPU, tiny ones that rehearse every
path in a minute or two. The landing stage's optional steps are one table: a step whose config
does not compose in this checkout (its key or group is not there yet) is skipped and says so;
edit its overrides here when its feature lands under another name.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import gpu_report as report
from gpu_check import CAP_ENV, REPO, Settings
from step_clock import PROFILE_ENV, PROFILE_STEPS_ENV


@dataclass(frozen=True)
class Shapes:
    big: str  # the model of the GPU tests' shape and the throughput stage
    model_8b: str
    seq: int
    batch: int  # throughput's micro-batch
    precision: str  # throughput's
    bench_steps: int  # per throughput run (bench_warmup of them warm-up)
    run_steps: int  # per command-line run of the adapters and landing stages
    long_seq: int  # the chunked loss's
    extra: tuple[str, ...]  # on every command line
    default_extra: tuple[str, ...]  # on the default command (none on CUDA: as a user types it)
    eager_8bit: tuple[str, ...]  # the 8-bit optimizer step compiled on CUDA, eager on the CPU
    runners: tuple[str, ...]  # the throughput stage's (benchmarks/throughput.py's keys), in order
    bench_warmup: int  # warm-up steps of a throughput run (3 steady steps follow on the CPU)
    bench_extra: tuple[str, ...]  # on the throughput stage's llama_fsdp runs (and its plan)
    capped_seq: int = 0  # 8B QLoRA's under a 24 GB cap (issue 50: 65,536 tokens)
    loss_seq: int = 0  # the chunked loss against the full loss (issue 50: 8B at 8,192)


_CPU_EXTRA = ("cluster.device=cpu", "cluster.nproc_per_node=1", "data.num_records=400")
# The throughput stage's runners, in order: llama_fsdp and the peers, then llama_fsdp on rows
# like the peers' (one record of the whole row each, ONE_RECORD: the issue's goals are judged
# on those), packed (flash varlen) and unpacked (SDPA's causal kernel, cuDNN on an H100 / H200),
# compiled; then, on the synthetic data's rows of hundreds of tiny records, flex_attention and
# the compiled layers alone (benchmarks/gpu.md, the second session: flash varlen is slow on
# those rows). The CPU rehearses the variant paths it can run (no compile: it would double the
# rehearsal's time; no flex: no backward on the CPU; the variant path is ONE_RECORD's), and
# every CPU runner is one the GPU runs.
ONE_RECORD = "llama_fsdp_one_record"
THROUGHPUT_RUNNERS = {
    "cuda": ("llama_fsdp", "hf_trainer", ONE_RECORD, f"{ONE_RECORD}_unpacked", "llama_fsdp_flex",
             "llama_fsdp_compile", "bare_fsdp2"),
    # the CPU rehearses the machinery with one framework runner (ONE_RECORD: FrameworkRunner with
    # options, the path every llama_fsdp runner takes) and two peers; the plain llama_fsdp
    # runner runs in docs' test_throughput (tests/integration/test_docs_commands.py)
    "cpu": ("hf_trainer", "bare_fsdp2", ONE_RECORD),
}
# llama_fsdp steps with torch's fused AdamW on CUDA and the CPU (optim.fused's default); the
# rehearsal's llama_fsdp runs say optim.fused=true all the same, so they step as the GPU's do
# whatever the default becomes (a separate llama_fsdp_fused runner, one more run, rehearsed it
# until then; tests/integration/test_gpu_check.py::test_throughput_reports_each_runner_with_mfu
# checks it).
# The CPU's 2 warm-up steps (5 on CUDA) leave its 3 steady steps and the 2 profiled among them:
# no number of the rehearsal is read as a speed.
SHAPES = {
    "cuda": Shapes("1b", "8b", 2048, 4, "mixed", 20, 6, 16384, ("cluster.nproc_per_node=1",),
                   (), (), THROUGHPUT_RUNNERS["cuda"], 5, (), capped_seq=65536,
                   loss_seq=8192),
    "cpu": Shapes("tiny", "tiny", 128, 2, "fp32", 5, 2, 256, _CPU_EXTRA,
                  (*_CPU_EXTRA, "train.max_steps=3", "train.warmup_steps=1", "eval.every_steps=0",
                   "eval.task_prompts=0"), ("optim.eager=true",), THROUGHPUT_RUNNERS["cpu"],
                  2, ("optim.fused=true",), capped_seq=512, loss_seq=256),
}

# The GPU tests that settle the most in about 2.5 minutes, most valuable first: CUDA's peak
# against the plan at the 1b shape (4 of its layers, seq 2048; seconds each), then bf16,
# compile (inductor's CUDA code, which the CPU never runs) and activation-checkpointed training
# through the command line (the default command, stage 1, is the mixed-precision run). On the
# CPU they are collected and skip.
_MEMORY = "tests/gpu/test_gpu_memory.py::test_cuda_peak_is_within_tolerance_of_the_plan"
_OPTION = "tests/gpu/test_gpu_run.py::test_each_option_trains_on_gpus"
GPU_TESTS = (
    # a second: whether the batch's copy waits for the running step (transfer.py)
    "tests/gpu/test_gpu_transfer.py::"
    "test_a_pageable_batch_is_queued_behind_running_work_without_a_host_wait",
    f"{_MEMORY}[full-mixed-none-4]", f"{_MEMORY}[full-mixed-full-4]",
    f"{_MEMORY}[full-bf16-none-4]", f"{_MEMORY}[full-bf16-full-1]",
    f"{_OPTION}[full-bf16]", f"{_OPTION}[compile]", f"{_OPTION}[ac-full]",
)


@dataclass(frozen=True)
class Landing:
    """A landing step: run when its overrides compose, else skipped with the reason."""

    name: str
    feature: str
    overrides: Callable[[Shapes], list[str]]
    # more overrides that need files made first (its data), and the run's environment
    prepare: Optional[Callable[[Settings, Shapes], list[str]]] = None
    env: tuple[tuple[str, str], ...] = ()


def _one_device(seq: int) -> list[str]:
    return ["precision=bf16", "checkpointing=full", "train.batch_size=1", f"train.seq_len={seq}"]


def adapter_overrides(sh: Shapes, method: str) -> list[str]:
    """8B (tiny on the CPU) with LoRA or QLoRA on one device."""
    return [f"model={sh.model_8b}", f"finetune={method}", *_one_device(sh.seq)]


def throughput_overrides(sh: Shapes, device: str) -> list[str]:
    """The throughput stage's llama_fsdp shape, as its plan (FLOPs per token, peak) sees it."""
    return [f"model={sh.big}", f"precision={sh.precision}", f"train.seq_len={sh.seq}",
            f"train.batch_size={sh.batch}", "checkpointing=none", f"cluster.device={device}",
            "cluster.nproc_per_node=1"]


# A 24 GB card on the GPU: the plan is told 24 GB (cluster.device_memory_gb; it then needs
# the activations offloaded to the host at 65,536 tokens: 19.5 GB planned, 35.6 without) and the
# CUDA allocator is capped at 24 GB (benchmarks/memory_cap.py), so a peak over it fails the run.
# Rows of one long record each (a long document, as long-context fine-tuning trains on): the
# synthetic task's thousands of tiny records a row would plan flash varlen's per-record
# workspace at 17.9 GB.
CAP_GB = 24


def _capped_data(s: Settings, sh: Shapes) -> list[str]:
    path = write_long_texts(s.work / "capped.jsonl", sh.run_steps + 4,
                            chars=int(1.4 * sh.capped_seq))
    return ["data=jsonl", f"data.path={path}", "data.eval_fraction=0"]


def _capped(sh: Shapes) -> list[str]:
    return [f"model={sh.model_8b}", "finetune=qlora", *_one_device(sh.capped_seq),
            "checkpointing.offload=true", f"cluster.device_memory_gb={CAP_GB}",
            'train.callbacks=["benchmarks.memory_cap:MemoryCap"]', "train.max_steps=2"]


def _loss(kind: str) -> Callable[[Shapes], list[str]]:
    """8B QLoRA at loss_seq with train.loss=KIND: the same seed, data and first batch, so the
    first step's loss of the two runs is the same number and their peaks differ by the logits."""
    return lambda sh: [f"model={sh.model_8b}", "finetune=qlora", f"train.loss={kind}",
                       *_one_device(sh.loss_seq), "train.max_steps=3"]


LANDING = (
    Landing("chunked-loss", "train.loss (the chunked loss, issue 40)",
            lambda sh: [f"model={sh.model_8b}", "finetune=qlora", "train.loss=chunked",
                        *_one_device(sh.long_seq)]),
    Landing("dpo-lora", "objective=dpo (DPO, issue 37)",
            lambda sh: [f"model={sh.model_8b}", "objective=dpo", "finetune=lora",
                        *_one_device(sh.seq)]),
    Landing("8b-adamw8bit", "optim=adamw8bit (8-bit AdamW moments)",
            lambda sh: [f"model={sh.model_8b}", "optim=adamw8bit", *_one_device(sh.seq),
                        *sh.eager_8bit]),
    Landing("qlora-65k-24gb", f"8B QLoRA at 65,536 tokens under a {CAP_GB} GB cap (issue 50)",
            _capped, prepare=_capped_data, env=(("MEMORY_CAP_GB", str(CAP_GB)),)),
    Landing("loss-full-8k", "train.loss=full at 8B, 8,192 tokens (issue 50)", _loss("full")),
    Landing("loss-chunked-8k", "train.loss=chunked at 8B, 8,192 tokens (issue 50)",
            _loss("chunked")),
)
LANDING_BY_NAME = {step.name: step for step in LANDING}


def listed(name: str, default: tuple[str, ...], valid: Optional[set[str]] = None
           ) -> tuple[str, ...]:
    """A comma-separated knob (RUNNERS, GPU_TESTS, BROKEN, LANDING), else ``default``; an
    unknown name is refused with the valid ones."""
    value = tuple(x.strip() for x in os.environ.get(name, "").split(",") if x.strip())
    if not value:
        return default
    unknown = [x for x in value if valid is not None and x not in valid]
    if unknown:
        raise SystemExit(f"{name}: unknown {unknown}; valid: {', '.join(sorted(valid or ()))}")
    return value


@dataclass(frozen=True)
class Mutation:
    """Code broken on purpose: ``old`` (once in ``path``) becomes ``new``; ``test`` must then
    fail, where on the code as it is it passes (issue 65: the GPU tests never run, shown to
    catch what they are about)."""

    test: str
    path: str
    old: str
    new: str
    what: str


MUTATIONS = {
    # resume restores the weights and optimizer but not the data's position: the resumed steps
    # see the first batches again, which an uninterrupted run's losses at steps 9-12 catch
    "resume-data-position": Mutation(
        "tests/gpu/test_gpu_run.py::test_hf_weights_in_export_out_and_resume",
        "llama_fsdp/checkpoint/dcp.py",
        'if self.data is not None and "data" in sd:',
        'if False and self.data is not None and "data" in sd:',
        "a resume that does not restore the data loader's position"),
    # the reference's log-probs replaced by the policy's own (detached): every reward is zero
    # and the loss stays ln 2, which the test's "the policy moved off the reference" catches
    "dpo-reference-is-policy": Mutation(
        "tests/gpu/test_gpu_dpo.py::test_8b_lora_dpo_tokens_per_s_and_peak_against_the_plan",
        "llama_fsdp/objective/dpo.py",
        "ratio_c, ratio_r = pc - reference[0::2], pr - reference[1::2]",
        "ratio_c, ratio_r = pc - pc.detach(), pr - pr.detach()",
        "DPO against the policy itself instead of the frozen reference"),
}


# What the setup stage imports (distribution, module): the image's and the carried wheels'.
IMPORTS = (("torch", "torch"), ("transformers", "transformers"), ("accelerate", "accelerate"),
           ("peft", "peft"), ("pyarrow", "pyarrow"), ("pandas", "pandas"),
           ("hydra-core", "hydra"), ("omegaconf", "omegaconf"), ("mlflow", "mlflow"),
           ("sqlalchemy", "sqlalchemy"), ("submitit", "submitit"), ("datasets", "datasets"),
           ("torchao", "torchao"), ("sentencepiece", "sentencepiece"), ("pytest", "pytest"))


# --- helpers -----------------------------------------------------------------------------------


def progress(name: str) -> None:
    report.append_here({"kind": "progress", "name": name})
    print(f"\n=== {name} ({time.strftime('%H:%M:%S')})", flush=True)


def shown(cmd: list[str], s: Settings) -> str:
    """A command as a person types it: python, $WORK for this check's folder."""
    text = " ".join(cmd).replace(sys.executable, "python").replace(str(s.work), "$WORK")
    return text.replace(str(REPO) + "/", "")


def peak_override() -> list[str]:
    peak = os.environ.get("PEAK_TFLOPS")
    return [f"cluster.peak_tflops={peak}"] if peak else []


def compose(overrides: list[str]) -> Any:
    """The config `python -m llama_fsdp OVERRIDES` composes (Hydra's compose API, the CLI's
    config package)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from llama_fsdp.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module("llama_fsdp.conf", version_base=None):
        return hydra_compose("config", overrides=overrides)


def compose_error(overrides: list[str]) -> Optional[str]:
    """None when the config composes with these overrides, else Hydra's reason (a key or a
    config group this checkout does not have)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        compose(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        # Hydra's first line, and the cause's ("Key 'loss' not in 'TrainConfig'")
        lines = [str(x).strip().splitlines()[0] for x in (e, e.__cause__) if x and str(x).strip()]
        return " ".join(lines)
    return None


def plan_of(overrides: list[str], work: Path) -> tuple[Any, Any]:
    """The composed config and llama_fsdp's plan of it (FLOPs per token, peak FLOP/s, peak)."""
    from llama_fsdp.plan import make_plan, resolve_auto
    from llama_fsdp.launchers import launcher_for
    from llama_fsdp.run.spec import build_spec

    cfg = compose([f"output_dir={work / 'plan'}", *overrides])
    return cfg, make_plan(resolve_auto(build_spec(
        cfg, placement=launcher_for(cfg.cluster).placement, launch_dir=work)))


def tokenizer_overrides(s: Settings) -> list[str]:
    """The synthetic task's tokenizer, named as data.tokenizer: the project's 512-piece tokenizer
    is refused by a model of another vocabulary (a sign that the model's own was not found);
    named, it is a tokenizer smaller than the embedding. The embedding gather and the
    full-vocabulary head and loss cost the same for any ids. (Named for tiny too, whose vocabulary
    it is, so that the CPU rehearsal takes this path.)"""
    path = s.work / "tokenizer"
    if not (path / "tokenizer_config.json").exists():
        from llama_fsdp.config.schema import DataConfig
        from llama_fsdp.data import build_tokenizer

        build_tokenizer(DataConfig(), s.work / "cache").save_pretrained(str(path))
    return [f"data.tokenizer={path}"]


def run_common(s: Settings, sh: Shapes, name: str) -> list[str]:
    return [f"train.max_steps={sh.run_steps}", "train.warmup_steps=1", "eval.every_steps=0",
            "eval.task_prompts=0", "save.every_steps=0", f"output_dir={s.work / 'runs' / name}",
            f"tracking.uri=sqlite:///{s.work / 'mlflow.db'}", f"cache_dir={s.work / 'cache'}",
            *tokenizer_overrides(s), *peak_override(), *sh.extra]


# --- a run of the command line ---------------------------------------------------------------


_DEVICE_LINE = re.compile(r"\bdevice\s+(\w+ \(\w+\))\s*$", re.M)
_ERROR_LINE = re.compile(r"^\S*\s*(\w+(Error|Exception)\b.*|error: .*)$", re.M)


def cli_run(s: Settings, name: str, overrides: list[str], *, cwd: Path,
            output_dir: Optional[Path] = None, env: Optional[dict[str, str]] = None) -> dict:
    """``python -m llama_fsdp OVERRIDES`` (output into the stage log, and read back), then
    what its MLflow run recorded: one ``run`` result."""
    progress(name)
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "llama_fsdp", *overrides]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", env={**os.environ, **(env or {})})
    lines = []
    for line in proc.stdout:  # type: ignore[union-attr]
        sys.stdout.write(line)
        lines.append(line)
        del lines[:-400]
    code = proc.wait()
    log = "".join(lines)
    uri = next((o.split("=", 1)[1] for o in overrides if o.startswith("tracking.uri=")),
               f"sqlite:///{cwd / 'outputs' / 'mlflow.db'}")
    shown_env = [f"{k}={v}" for k, v in (env or {}).items()]
    record = {"kind": "run", "name": name, "command": shown([*shown_env, "python", "-m",
                                                             "llama_fsdp", *overrides], s),
              "exit_code": code, "elapsed_s": round(time.monotonic() - start, 1),
              **mlflow_readout(uri, output_dir)}
    device = _DEVICE_LINE.search(log)
    record["device"] = device.group(1) if device else None
    if code != 0:
        record["error"] = _last_error(log)
    return report.append_here(record)


def _last_error(log: str) -> str:
    """The last exception or error line of a failed run's output (its last line otherwise)."""
    errors = _ERROR_LINE.findall(log)
    lines = log.strip().splitlines()
    return (errors[-1][0] if errors else lines[-1] if lines else "no output")[:300]


def mlflow_readout(uri: str, output_dir: Optional[Path]) -> dict:
    """The run's status, loss curve ends, tokens/s, MFU and peaks from its MLflow store."""
    path = Path(uri.removeprefix("sqlite:///"))
    if uri.startswith("sqlite:///") and not path.exists():
        return {"status": "no MLflow run"}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
            if r.data.tags.get("llama_fsdp.kind") != "sweep"
            and (output_dir is None or r.data.tags.get("output_dir") == str(output_dir))]
    if not runs:
        return {"status": "no MLflow run"}
    run = max(runs, key=lambda r: r.info.start_time)
    m, tags = run.data.metrics, run.data.tags

    def history(key: str) -> list[float]:
        return [x.value for x in sorted(client.get_metric_history(run.info.run_id, key),
                                        key=lambda x: x.step)]

    # (a DPO run's loss is dpo_loss in MLflow: llama_fsdp/config/metrics.py's DPO_LOGGED_AS)
    losses = history("loss") or history("dpo_loss")
    reserved = history("peak_memory_reserved_gb")
    return {"status": run.info.status, "steps": len(losses),
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "tokens_per_s": m.get("summary/tokens_per_sec"), "mfu": m.get("summary/mfu"),
            "peak_allocated_gb": m.get("summary/peak_memory_gb"),
            "peak_reserved_gb": max(reserved) if reserved else None,
            "predicted_peak_gb": m.get("summary/predicted_peak_memory_gb",
                                       m.get("predicted_peak_memory_gb")),
            "attention": tags.get("attention"), "precision": tags.get("precision"),
            "mlflow_run": run.info.run_id}


# --- the stages ------------------------------------------------------------------------------


_CHECK_IMPORTS = """
import importlib, importlib.metadata as md, json, platform, sys
site = sys.argv[1]
out = {"python": platform.python_version(), "versions": {}, "origin": {}, "missing": {}}
for dist, module in json.loads(sys.argv[2]):
    try:
        mod = importlib.import_module(module)
    except Exception as e:
        out["missing"][dist] = f"{type(e).__name__}: {e}"
        continue
    version = getattr(mod, "__version__", None)
    if not isinstance(version, str):
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            version = "?"
    out["versions"][dist] = version
    out["origin"][dist] = "carried" if site and (mod.__file__ or "").startswith(site) else "image"
try:
    import llama_fsdp.cli.command, llama_fsdp.train.worker
    from llama_fsdp.versions import version_problems
    out["missing"].update({"llama_fsdp floors": p for p in version_problems()})
except Exception as e:
    out["missing"]["llama_fsdp"] = f"{type(e).__name__}: {e}"
import torch
out["cuda_available"] = torch.cuda.is_available()
out["cuda"] = torch.version.cuda
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out.update(device=p.name, memory_gb=p.total_memory / 1e9, gpus=torch.cuda.device_count(),
               capability=f"{p.major}.{p.minor}")
print("IMPORTS " + json.dumps(out))
"""


def setup(s: Settings) -> int:
    """Install the carried wheels (no index, no dependencies, into WORK/site), then import
    everything a run needs in a fresh interpreter, and record the machine."""
    wheels = sorted(s.wheels.glob("*.whl"))
    if wheels:
        progress(f"pip install {len(wheels)} wheels from {s.wheels.name}")
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                              "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
                              "--target", str(s.site), *map(str, wheels)])
        if pip.returncode != 0:
            print(f"pip could not install {s.wheels}: see above", flush=True)
            return pip.returncode
    progress("imports")
    out = subprocess.run([sys.executable, "-c", _CHECK_IMPORTS, str(s.site) if wheels else "",
                          json.dumps(IMPORTS)], capture_output=True, text=True, cwd=REPO)
    print(out.stdout + out.stderr, flush=True)
    found = re.search(r"^IMPORTS (.*)$", out.stdout, re.M)
    info = json.loads(found.group(1)) if found else {"missing": {"python": out.stderr[-500:]}}
    record = {"kind": "machine", "date": time.strftime("%Y-%m-%d %H:%M"),
              "device": info.get("device") or ("CPU (rehearsal)" if s.device == "cpu" else None),
              "memory_gb": info.get("memory_gb"), "cuda": info.get("cuda"),
              "driver": _driver(), "python": info.get("python"),
              "versions": {k: f"{v} ({info['origin'][k]})" if info["origin"].get(k) == "carried"
                           else v for k, v in info.get("versions", {}).items()},
              "missing": info.get("missing"), "command": _invocation(s),
              "wheels": f"{len(wheels)} from {s.wheels.name}/ "
                        f"({sum(w.stat().st_size for w in wheels) / 2**20:.1f} MiB)"
                        if wheels else None}
    report.append_here(record)
    if info.get("missing"):
        print(f"cannot run the check: {info['missing']}\nbuild the wheelhouse with "
              "`bash scripts/offline_wheels.sh` and carry .whl (docs/gpu.md)", flush=True)
        return 1
    if s.device == "cuda" and not info.get("cuda_available"):
        print("DEVICE=cuda but torch sees no GPU here (DEVICE=cpu rehearses the check on the "
              "CPU)", flush=True)
        return 1
    return 0


def _driver() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() \
        else None


def _invocation(s: Settings) -> str:
    knobs = [f"{k}={os.environ[k]}" for k in ("DEVICE", "TOTAL_S", "STAGES", "PEAK_TFLOPS")
             if os.environ.get(k) and not (k == "DEVICE" and s.device == "cuda")]
    knobs += [f"CAP_{n.upper().replace('-', '_')}={v:g}" for n, v in s.caps.items()]
    return " ".join([*knobs, "bash scripts/gpu_check.sh"])


def default(s: Settings, sh: Shapes) -> int:
    """The README's first command, on this machine's GPU(s), in a folder of its own."""
    cwd = s.work / "default"
    cli_run(s, "default", [*sh.default_extra, *peak_override()], cwd=cwd)
    return 0


def _pytest(tests: tuple[str, ...], cwd: Path, env: Optional[dict[str, str]] = None) -> int:
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "-p", "benchmarks.gpu_check_pytest", "-m", "gpu", "-rfEs", *tests],
                           cwd=cwd, env=env)


def gpu_tests(s: Settings, sh: Shapes) -> int:
    """GPU_TESTS (or the knob's) through pytest; benchmarks/gpu_check_pytest.py appends one
    result per test. Then each BROKEN mutation's test on a copy of the checkout broken on
    purpose (its results say ``broken``: the test should fail there)."""
    progress("pytest")
    code = _pytest(listed("GPU_TESTS", GPU_TESTS), REPO)
    worst = 0 if code in (0, 1) else code  # 1: some tests failed (results); more: pytest broke
    for name in listed("BROKEN", (), set(MUTATIONS)):
        progress(f"broken: {name}")
        broken = break_copy(MUTATIONS[name], s.work / "broken" / name)
        path = [str(broken), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                               if p and Path(p).resolve() != REPO]]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), report.BROKEN_ENV: name}
        imported = subprocess.run([sys.executable, "-c", "import llama_fsdp; print(llama_fsdp."
                                   "__file__)"], cwd=broken, env=env, capture_output=True,
                                  text=True).stdout.strip()
        if not imported.startswith(str(broken)):  # the test would run the unbroken code
            raise SystemExit(f"broken copy {broken}: llama_fsdp imports from {imported!r}")
        code = _pytest((MUTATIONS[name].test,), broken, env)
        worst = worst or (0 if code in (0, 1) else code)
    return worst


def break_copy(m: Mutation, dest: Path) -> Path:
    """A copy of the checkout (no outputs, wheels, the floor's overlay or caches) with ``m``
    applied."""
    import shutil

    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".whl", ".floor", ".gl", "outputs", "__pycache__", "*.egg-info",
        ".pytest_cache", "node_modules"))
    target = dest / m.path
    text = target.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutation of {m.path}: {m.old!r} is there {text.count(m.old)} times, "
                         "not once (edit gpu_check_stages.MUTATIONS to the code as it is now)")
    target.write_text(text.replace(m.old, m.new))
    return dest


def throughput(s: Settings, sh: Shapes) -> int:
    """benchmarks/throughput.py's runners, one round, each run's result appended as it ends."""
    import throughput as tp
    from throughput_report import summarize
    from throughput_runners import Bench, execute

    work = s.work / "throughput"
    work.mkdir(parents=True, exist_ok=True)
    extra = [*tokenizer_overrides(s), *peak_override(), *sh.bench_extra,
             *[o for o in sh.extra if o.startswith("data.")]]
    cfg, plan = plan_of([*throughput_overrides(sh, s.device), *extra], work)
    from omegaconf import OmegaConf

    (work / "shape.json").write_text(json.dumps(OmegaConf.to_container(cfg.model, resolve=True)))
    venv = work / "venv" / "bin"  # the peers run on this interpreter
    venv.mkdir(parents=True, exist_ok=True)
    (venv / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "python").chmod(0o755)
    bench = Bench(device=s.device, ranks=1, model=sh.big, batch_size=sh.batch, seq_len=sh.seq,
                  steps=sh.bench_steps, warmup=sh.bench_warmup, precision=sh.precision,
                  main_python=Path(sys.executable), bench_python=venv / "python",
                  shape_file=work / "shape.json", framework_overrides=tuple(extra))
    shape = (f"{sh.big}, seq {sh.seq}, micro-batch {sh.batch}, {sh.precision}, one device, "
             f"{sh.bench_steps} steps ({sh.bench_warmup} warm-up)")
    timeout = 0.6 * float(os.environ.get(CAP_ENV, 600))  # a hung run leaves time to the next
    # where each runner's step goes: torch.profiler over a few steady steps (step_clock.py)
    first = min(sh.bench_warmup + 3, sh.bench_steps - 2)
    os.environ[PROFILE_STEPS_ENV] = f"{first}:{min(first + 2, sh.bench_steps - 1)}"
    runners = listed("RUNNERS", sh.runners)
    for runner in tp.build_runners(bench, list(runners), clock=True,
                                   more=one_record_runners(bench, work, sh)):
        progress(runner.key)
        profile = work / f"{runner.key}.profile.json"
        os.environ[PROFILE_ENV] = str(profile)
        summary = summarize(runner, [execute(runner, work / runner.key, round_no=1,
                                             timeout_s=timeout)], sh.bench_warmup)
        _show_logs(runner.logs(work / runner.key))
        if profile.exists():
            report.append_here({"kind": "profile", "runner": runner.key, "label": runner.label,
                                "steps_profiled": os.environ[PROFILE_STEPS_ENV],
                                "step_ms": summary.median * 1000 if summary.median else None,
                                **json.loads(profile.read_text())})
        tps = bench.tokens_per_step / summary.median if summary.median else None
        mfu = (tps * plan.flops_per_token / plan.peak_flops
               if tps and plan.peak_flops else None)
        report.append_here({
            "kind": "throughput", "runner": runner.key, "label": runner.label, "shape": shape,
            "ran": summary.info.get("ran"), "tokens_per_s": tps,
            "ms_per_step": summary.median * 1000 if summary.median else None, "mfu": mfu,
            "steady_steps": len(summary.walls), "error": summary.error,
            "command": runner.shown_command().replace(str(s.work), "$WORK")})
    return 0


def write_long_texts(path: Path, n: int, *, chars: int, seed: int = 0) -> Path:
    """``n`` JSON-lines records {"text": ...} of seeded random words, each ``chars`` characters
    or a little more (benchmarks/gpu_probe.sh's long records too)."""
    import random

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(3000)]
    with path.open("w") as f:
        for _ in range(n):
            text, size = [], 0
            while size < chars:
                text.append(rng.choice(words))
                size += len(text[-1]) + 1
            f.write(json.dumps({"text": " ".join(text)}) + "\n")
    return path


def one_record_runners(bench: Any, work: Path, sh: Shapes) -> dict[str, Callable[[], Any]]:
    """llama_fsdp on rows of one record each, as the peers' rows are: a JSON-lines file of
    random-word texts longer than a row (the synthetic tokenizer spends ~0.85 tokens a
    character on them; data.overlong=truncate cuts each to the row), trained compiled (on the
    CPU, as it is), packed (one record a row: flash varlen over whole rows) and unpacked (SDPA's
    causal kernel)."""
    from throughput_runners import FrameworkRunner

    path = write_long_texts(work / "one_record.jsonl", sh.batch * (sh.bench_steps + 2),
                            chars=int(1.5 * sh.seq))
    data = ("data=jsonl", f"data.path={path}", "data.eval_fraction=0")
    compiled = ("train.compile=true",) if bench.device == "cuda" else ()
    return {
        ONE_RECORD: lambda: FrameworkRunner(
            bench, sharding="full", clock=True, name="one_record", options=(*data, *compiled),
            what="rows of one record each, as the peers'" + (", compiled" if compiled else "")),
        f"{ONE_RECORD}_unpacked": lambda: FrameworkRunner(
            bench, sharding="full", clock=True, name="one_record_unpacked",
            options=(*data, "data.packing=false", *compiled),
            what="rows of one record each, unpacked: SDPA causal"
                 + (", compiled" if compiled else "")),
    }


def _show_logs(paths: list[Path], lines: int = 150) -> None:
    """The end of a throughput run's own log, into the stage log (the run folder stays here)."""
    for path in paths[:1]:
        if path.exists():
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            print(f"--- {path.name}, last {len(tail)} lines\n" + "\n".join(tail), flush=True)


def adapters_8b(s: Settings, sh: Shapes) -> int:
    """8B QLoRA, then LoRA, on one device: bf16, every layer checkpointed, micro-batch 1."""
    for method in ("qlora", "lora"):
        name = f"8b-{method}" if sh.model_8b == "8b" else f"{sh.model_8b}-{method}"
        cli_run(s, name, [*adapter_overrides(sh, method), *run_common(s, sh, name)],
                cwd=s.work / "cli", output_dir=s.work / "runs" / name)
    return 0


def landing(s: Settings, sh: Shapes) -> int:
    """Each optional step whose feature this checkout has; the others say why they skip."""
    for name in listed("LANDING", tuple(LANDING_BY_NAME), set(LANDING_BY_NAME)):
        step = LANDING_BY_NAME[name]
        own = step.overrides(sh)
        mine = {o.split("=", 1)[0] for o in own}  # the step's keys win over the common ones
        overrides = [*own, *[o for o in run_common(s, sh, step.name)
                             if o.split("=", 1)[0] not in mine]]
        why = compose_error(own)
        if why is not None:
            report.append_here({"kind": "skipped", "name": step.name,
                                "reason": f"{step.feature} is not in this checkout: {why}",
                                "command": shown(["python", "-m", "llama_fsdp", *overrides], s)})
            continue
        if step.prepare is not None:
            overrides += step.prepare(s, sh)
        cli_run(s, step.name, overrides, cwd=s.work / "cli", output_dir=s.work / "runs" / step.name,
                env=dict(step.env))
    return 0


STAGE_BODIES: dict[str, Callable[..., int]] = {
    "default": default, "gpu-tests": gpu_tests, "throughput": throughput,
    "adapters-8b": adapters_8b, "landing": landing,
}


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    """A cut stage unwinds (SystemExit), so the runs it started are ended with it."""
    raise SystemExit(128 + signum)


def run(name: str, s: Settings) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if name == "setup":
        return setup(s)
    return STAGE_BODIES[name](s, SHAPES[s.device])
