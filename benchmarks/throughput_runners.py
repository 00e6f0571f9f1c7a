"""The runners benchmarks/throughput.py compares, and how one run of each is started and read.

Every runner is a command (llama_fsdp's real CLI, or torchrun over a peer in
benchmarks/peers/) plus a way to read its rank-0 step-end stamps afterwards. Runs are plain
subprocesses in their own session, so a run that hangs is killed whole (torchrun and its
ranks, or submitit and its ranks) and nothing else is touched.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from step_clock import CLOCK_ENV, read_stamps

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
CLOCK_HOOK = "benchmarks.step_clock:StepClock"
CLOCK_FILE = "clock.jsonl"
INFO_FILE = "info.json"
LOG_FILE = "output.log"
RANK_LOGS = "ranks"  # torchrun --log-dir: one stdout/stderr pair per rank


@dataclass(frozen=True)
class Bench:
    """One benchmark's settings: the same for every runner."""

    device: str
    ranks: int
    model: str
    batch_size: int
    seq_len: int
    steps: int
    warmup: int
    precision: str
    main_python: Path
    bench_python: Path
    shape_file: Path
    framework_overrides: tuple[str, ...] = ()

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.ranks

    @property
    def threads_per_rank(self) -> int:
        """Host cores split evenly between the ranks, as llama_fsdp does by default."""
        return max(1, (os.cpu_count() or 1) // self.ranks)


@dataclass
class RunResult:
    """One run of one runner in one round."""

    runner: str
    round: int
    elapsed_s: float
    stamps: dict[int, float] = field(default_factory=dict)
    cpu_stamps: dict[int, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    # a run that stamped every step and then exited abnormally (a crash in interpreter or
    # process-group teardown): its steps count, and the report lists the exit
    exit_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Runner:
    """A command run from the repository root, timed by its rank-0 step clock file."""

    key = ""
    label = ""
    timing = f"step clock (`{CLOCK_HOOK}`)"
    diagnostic = False  # a variant that explains a gap, reported in its own table

    def __init__(self, bench: Bench):
        self.bench = bench

    def command(self, run_dir: Path) -> list[str]:
        raise NotImplementedError

    def env(self, run_dir: Path) -> dict[str, str]:
        """The clock file, the repository importable (benchmarks.*), the CPU threads per rank."""
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        return {CLOCK_ENV: str(run_dir / CLOCK_FILE), "PYTHONPATH": path,
                "OMP_NUM_THREADS": str(self.bench.threads_per_rank)}

    def stamps(self, run_dir: Path) -> dict[int, float]:
        return read_stamps(run_dir / CLOCK_FILE)

    def cpu_stamps(self, run_dir: Path) -> dict[int, float]:
        return read_stamps(run_dir / CLOCK_FILE, "cpu")

    def info(self, run_dir: Path) -> dict[str, Any]:
        path = run_dir / INFO_FILE
        return json.loads(path.read_text()) if path.exists() else {}

    def logs(self, run_dir: Path) -> list[Path]:
        """Where to look for the cause of a failure, most specific first."""
        return [run_dir / LOG_FILE]

    def shown_command(self) -> str:
        """The command as a person would type it, with $RUN for the per-run directory."""
        run = Path("/RUN")
        env = " ".join(f"{k}={v}" for k, v in self.env(run).items())
        text = f"{env} {shlex.join(self.command(run))}"
        return text.replace(str(run), "$RUN").replace(str(REPO) + "/", "").replace(str(REPO), ".")


class FrameworkRunner(Runner):
    """llama_fsdp through its CLI, on its synthetic packed data, eval and checkpoints off.

    With ``clock=True`` the step clock is installed through ``train.callbacks``; without it
    (a framework that does not have that option yet) tracking stays on, into a private sqlite
    store in the run directory, and the stamps are the timestamps of the ``step_time_s``
    metric history (ms resolution, taken right after each step).
    """

    def __init__(self, bench: Bench, *, sharding: str, clock: bool, packing: bool = True,
                 attention: Optional[str] = None, options: tuple[str, ...] = (),
                 name: Optional[str] = None, what: Optional[str] = None):
        super().__init__(bench)
        self.sharding, self.clock, self.packing = sharding, clock, packing
        self.attention = attention  # None: model.attn_implementation=auto
        self.options = options  # more overrides (e.g. train.compile=true): a variant
        # ``name``: the variant's key suffix (else made from the options' keys); ``what``: its
        # label (else the options themselves)
        self.key = "llama_fsdp" if sharding == "full" else f"llama_fsdp_{sharding}"
        self.label = f"llama_fsdp (sharding={sharding})"
        if not packing:
            self.key += "_unpacked"
            self.label = f"llama_fsdp (sharding={sharding}, data.packing=false)"
            self.diagnostic = True
        if attention is not None:
            self.key += f"_{attention}"
            self.label = f"llama_fsdp (sharding={sharding}, model.attn_implementation={attention})"
            self.diagnostic = True
        if options:  # train.compile=true -> _compile; optim.fused=true -> _fused
            self.key += ("_" + name if name else
                         "".join("_" + o.split("=")[0].split(".")[-1] for o in options))
            self.label = f"llama_fsdp (sharding={sharding}, {what or ' '.join(options)})"
            self.diagnostic = True
        if not clock:
            self.timing = "FALLBACK: MLflow `step_time_s` history timestamps (no train.callbacks)"

    def overrides(self, run_dir: Path) -> list[str]:
        b = self.bench
        out = [f"model={b.model}", f"sharding={self.sharding}", f"precision={b.precision}",
               "checkpointing=none", f"train.batch_size={b.batch_size}", "train.grad_accum=1",
               f"train.seq_len={b.seq_len}", f"train.max_steps={b.steps}",
               "eval.every_steps=0", "eval.task_prompts=0", "save.every_steps=0", "resume=none",
               f"cluster.device={b.device}", f"cluster.nproc_per_node={b.ranks}",
               f"hydra.run.dir={run_dir / 'run'}"]
        if not self.packing:
            out.append("data.packing=false")
        if self.attention is not None:
            out.append(f"model.attn_implementation={self.attention}")
        out += list(self.options)
        if self.clock:
            out += ["tracking.enabled=false", f'train.callbacks=["{CLOCK_HOOK}"]']
        else:
            out += [f"tracking.uri=sqlite:///{run_dir / 'mlflow.db'}"]
        return out + list(b.framework_overrides)

    def command(self, run_dir: Path) -> list[str]:
        return [str(self.bench.main_python), "-m", "llama_fsdp", *self.overrides(run_dir)]

    def stamps(self, run_dir: Path) -> dict[int, float]:
        if self.clock:
            return super().stamps(run_dir)
        return {step: t for step, (t, _) in mlflow_step_times(run_dir).items()}

    def info(self, run_dir: Path) -> dict[str, Any]:
        """What the framework ran: its own sharding; in fallback mode, its inner step time."""
        data = "packed rows" if self.packing else "one record per row, right-padded"
        how = "DDP (composable replicate)" if self.sharding == "no_shard" else "FSDP2"
        # the attention the run resolved, from its printed summary ("attention   varlen")
        printed = re.search(r"^\S*\s*attention\s+(\S+)$", (run_dir / LOG_FILE).read_text()
                            if (run_dir / LOG_FILE).exists() else "", re.M)
        attn = f", attention {printed.group(1)}" if printed else ""
        info = {"ran": f"{how}, sharding={self.sharding} (framework CLI; {data}{attn})"}
        if not self.clock:
            inner = [s for step, (_, s) in mlflow_step_times(run_dir).items()
                     if step > self.bench.warmup]
            info["inner_step_time_s"] = inner
        return info


def mlflow_step_times(run_dir: Path) -> dict[int, tuple[float, float]]:
    """step -> (log timestamp in s, step_time_s) of the only run in the run's private store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = [r for e in client.search_experiments()
            for r in client.search_runs([e.experiment_id])]
    if len(runs) != 1:
        raise RuntimeError(f"expected one MLflow run in {run_dir}, found {len(runs)}")
    history = client.get_metric_history(runs[0].info.run_id, "step_time_s")
    return {m.step: (m.timestamp / 1000.0, m.value) for m in history}


class PeerRunner(Runner):
    """A peer in benchmarks/peers/, one process per rank under torchrun, in the peer venv."""

    def __init__(self, bench: Bench, *, key: str, label: str, module: str,
                 extra: tuple[str, ...] = (), diagnostic: bool = False):
        super().__init__(bench)
        self.key, self.label, self.module, self.extra = key, label, module, extra
        self.diagnostic = diagnostic

    def command(self, run_dir: Path) -> list[str]:
        b = self.bench
        return [str(b.bench_python), "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={b.ranks}", f"--log-dir={run_dir / RANK_LOGS}", "--tee=3",
                "-m", self.module, "--shape", str(b.shape_file),
                "--batch-size", str(b.batch_size), "--seq-len", str(b.seq_len),
                "--steps", str(b.steps), "--precision", b.precision, "--device", b.device,
                "--info", str(run_dir / INFO_FILE), *self.extra]

    def logs(self, run_dir: Path) -> list[Path]:
        """Each rank's own stderr (rank 0 first): the ranks' tracebacks do not interleave there."""
        ranks = sorted((run_dir / RANK_LOGS).glob("**/stderr.log"), key=lambda p: p.parent.name)
        return [*ranks, *super().logs(run_dir)]


def execute(runner: Runner, run_dir: Path, *, round_no: int, timeout_s: float) -> RunResult:
    """Run once; the result holds the stamps, or the root cause of the failure."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / LOG_FILE
    start = time.monotonic()
    with log_path.open("w") as out:
        proc = subprocess.Popen(runner.command(run_dir), cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **runner.env(run_dir)},
                                start_new_session=True)
        rc = _wait(proc, timeout_s)
    result = RunResult(runner.key, round_no, time.monotonic() - start)
    if rc != 0:
        reason = "timed out" if rc is None else f"exit code {rc}"
        cause = f"{reason}: {first_root_cause(runner.logs(run_dir))}"
        if rc is None or len(_stamps_or_none(runner, run_dir)) < runner.bench.steps:
            result.error = cause
            return result
        result.exit_error = cause
    result.stamps, result.info = runner.stamps(run_dir), runner.info(run_dir)
    result.cpu_stamps = runner.cpu_stamps(run_dir)
    if len(result.stamps) < runner.bench.steps:
        result.error = (f"only {len(result.stamps)} of {runner.bench.steps} step stamps "
                        f"(see {log_path})")
    return result


def _stamps_or_none(runner: Runner, run_dir: Path) -> dict[int, float]:
    """The run's step stamps, or none where a failed run left nothing readable."""
    try:
        return runner.stamps(run_dir)
    except Exception:  # noqa: BLE001 - a failed run may leave no or partial stamp files
        return {}


def _wait(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """The exit code, or None after killing the run's whole process group on timeout.

    If the benchmark itself is interrupted (Ctrl-C, SIGTERM), the run is killed too: its
    ranks live in their own session and would otherwise go on alone.
    """
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return None
    except BaseException:
        _kill_group(proc)
        raise


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the run's process group (launcher and ranks), SIGKILL what is left after 15 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


_EXCEPTION = re.compile(r"^(\w+\.)*\w*(Error|Exception|Interrupt|Exit)\b.*$")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")  # torch prefixes a rank's stderr with it


def first_root_cause(logs: list[Path]) -> str:
    """The root cause from the first log that has a traceback, else from the last log."""
    texts = [p.read_text(errors="replace") for p in logs if p.exists()]
    with_traceback = [t for t in texts if "Traceback (most recent call last)" in t]
    return root_cause((with_traceback or texts or [""])[0 if with_traceback else -1])


def root_cause(log_text: str) -> str:
    """The first traceback's exception and its two innermost frames, or the last log line.

    The first traceback is the failing rank's own; later ones are the launcher's echo
    (ChildFailedError, LaunchError) of the same failure.
    """
    lines = [_RANK_PREFIX.sub("", line) for line in log_text.splitlines()]
    frames: list[str] = []
    in_traceback = False
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            in_traceback, frames = True, []
        elif in_traceback and (m := _FRAME.match(line)):
            frames.append(f"{_short(m['file'])}:{m['line']} {m['func']}")
        elif in_traceback and _EXCEPTION.match(line):
            return f"{line.strip()} (in {' -> '.join(frames[-2:])})" if frames else line.strip()
    tail = [line.strip() for line in lines if line.strip()]
    return tail[-1] if tail else "no output"


def _short(path: str) -> str:
    for marker in ("site-packages/", str(REPO) + "/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path
