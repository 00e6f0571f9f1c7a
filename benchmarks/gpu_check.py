"""The GPU check: the whole GPU session in one command, its stages in order of value, each under
its own time cap, every result written the moment it is known.

    bash scripts/gpu_check.sh                        # on the GPU machine (docs/gpu.md)
    DEVICE=cpu PY=.venv/bin/python bash scripts/gpu_check.sh   # the rehearsal, tiny shapes

Each stage is a process of its own (``gpu_check.py --stage NAME``, the work in
gpu_check_stages.py) in a process group of its own, its output in ``$OUT/<stage>.log``; at its
cap it is ended with everything it started (its process group, and every process that carries
the stage's token in its environment, which also finds the runs that start their own session),
and the next stage starts. SIGTERM or SIGINT to the check ends the stage in progress the same
way before the check exits. Results go to ``$OUT/results.jsonl`` as they come, with ``$OUT/summary.md``
rendered from them (benchmarks/gpu_report.py), so a check cut short still returns what it
measured. ``$OUT`` holds at most 8 files (the device tool returns 8), none in a folder.

Knobs (environment): DEVICE (cuda; cpu rehearses with tiny shapes), OUT (the device tool's
folder; default outputs/gpu-check/<time>), WORK (run folders, wheels installed; default
/tmp/gpu-check/<time>), WHEELS (.whl, the carried wheelhouse), TOTAL_S (480: every stage
ends by then), CAP_<STAGE> (one stage's cap in seconds, e.g. CAP_GPU_TESTS=120), STAGES (a
comma-separated subset, run in the order given, e.g. STAGES=throughput; setup always runs
first), RUNNERS (the throughput stage's runners, comma-separated: benchmarks/throughput.py's
keys), GPU_TESTS (the gpu-tests stage's pytest node ids, comma-separated), BROKEN (mutations of
gpu_check_stages.MUTATIONS whose tests the gpu-tests stage runs again on code broken on purpose,
to show they fail), LANDING (the landing steps, comma-separated names), GRACE_S (5: SIGTERM to
SIGKILL), PEAK_TFLOPS (cluster.peak_tflops for MFU where the accelerator table has no entry:
the CPU). On the CPU every default cap and TOTAL_S are CPU_SLOWER (4) times longer.

Stdlib only here: the dependencies are installed by the first stage.
"""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import gpu_report as report

REPO = Path(__file__).resolve().parent.parent
TOKEN_ENV = "GPU_CHECK_TOKEN"  # every process a stage starts inherits it: how a cut finds them
CAP_ENV = "GPU_CHECK_CAP"  # the stage's cap in seconds, for a stage that times its own steps
MIN_LEFT_S = 15.0  # a stage is not started with less than this left of TOTAL_S
LOG_HEAD, LOG_TAIL = 6 * 2**20, 2 * 2**20  # a stage log over both is cut in the middle
MAX_FILES = 8  # the device tool returns at most 8 files from $OUT
TOTAL_S = 480  # 8 minutes on the GPU
CPU_SLOWER = 4  # the rehearsal's caps: tiny shapes on a few busy cores are slower than a GPU


@dataclass(frozen=True)
class Stage:
    name: str
    cap_s: Optional[float]  # None: whatever is left of TOTAL_S
    what: str

    @property
    def env_cap(self) -> str:
        return "CAP_" + self.name.upper().replace("-", "_")

    @property
    def log(self) -> str:
        return f"{self.name}.log"


# In order of value (issue 42). The caps add up to TOTAL_S: a stage that ends early leaves its
# time to the last one. Settings per device (shapes, steps, the tests chosen): gpu_check_stages.
STAGES = (
    Stage("setup", 45, "the carried wheels installed, the imports checked, the machine read"),
    Stage("default", 75, "the default command (nccl, mixed, varlen): loss, tokens/s, MFU, "
                         "peak allocated and reserved"),
    Stage("gpu-tests", 150, "GPU tests: CUDA peak against the plan at the 1b shape; bf16, "
                            "activation checkpointing and compile training"),
    Stage("throughput", 105, "1b, seq 2048: llama_fsdp, HF Trainer, the bare FSDP2 loop; one "
                             "round; MFU and ratios"),
    Stage("adapters-8b", 105, "8B QLoRA and LoRA on one GPU (random init): peak against the "
                              "plan, tokens/s"),
    Stage("landing", None, "what has landed since: the chunked loss at a long sequence, DPO "
                           "with LoRA, 8B with 8-bit moments (absent ones are skipped)"),
)
assert len(STAGES) + 2 <= MAX_FILES, "a log per stage, results.jsonl and summary.md"
BY_NAME = {s.name: s for s in STAGES}


@dataclass
class Settings:
    device: str
    out: Path
    work: Path
    wheels: Path
    total_s: float
    grace_s: float
    only: tuple[str, ...]
    caps: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Optional[dict[str, str]] = None) -> "Settings":
        env = dict(os.environ if env is None else env)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        device = env.get("DEVICE", "cuda")
        if device not in ("cuda", "cpu"):
            raise SystemExit(f"DEVICE={device}: cuda (the GPU check) or cpu (its rehearsal)")
        only = tuple(s for s in env.get("STAGES", "").split(",") if s)
        unknown = [s for s in only if s not in BY_NAME]
        if unknown:
            raise SystemExit(f"STAGES: unknown stage(s) {unknown}; valid: {', '.join(BY_NAME)}")
        caps = {s.name: float(env[s.env_cap]) for s in STAGES if env.get(s.env_cap)}
        return cls(device=device,
                   out=Path(env.get("OUT") or REPO / "outputs" / "gpu-check" / stamp).absolute(),
                   work=Path(env.get("WORK") or f"/tmp/gpu-check/{stamp}").absolute(),
                   wheels=Path(env.get("WHEELS") or REPO / ".whl").absolute(),
                   total_s=float(env.get("TOTAL_S") or TOTAL_S * cls.slower(device)),
                   grace_s=float(env.get("GRACE_S", 5)),
                   only=only, caps=caps)

    @staticmethod
    def slower(device: str) -> int:
        return CPU_SLOWER if device == "cpu" else 1

    @property
    def site(self) -> Path:
        """Where the carried wheels are installed (pip --target)."""
        return self.work / "site"

    def stages(self) -> list[Stage]:
        """The stages asked for (STAGES), in the order asked (most valuable first), setup
        always and first: a fresh machine has no wheels installed."""
        if not self.only:
            return list(STAGES)
        return [BY_NAME["setup"], *[BY_NAME[n] for n in dict.fromkeys(self.only) if n != "setup"]]

    def cap(self, stage: Stage, left: float) -> float:
        default = stage.cap_s * self.slower(self.device) if stage.cap_s else left
        return min(self.caps.get(stage.name, default), left)

    def env(self) -> dict[str, str]:
        """What every stage process runs with: the settings, resolved; the wheels, the checkout."""
        path = [str(self.site)] if any(self.wheels.glob("*.whl")) else []
        path += [str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
        return {**os.environ, "DEVICE": self.device, "OUT": str(self.out),
                "WORK": str(self.work), "WHEELS": str(self.wheels), report.OUT_ENV: str(self.out),
                "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}


# --- ending a stage ----------------------------------------------------------------------------


def token_pids(token: str) -> list[int]:
    """Processes whose environment carries this stage's token (its descendants, wherever they
    moved: a new session, a new process group, a dead parent)."""
    needle = f"{TOKEN_ENV}={token}".encode() + b"\0"
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                out.append(int(entry.name))
        except OSError:  # gone, or another user's
            continue
    return out


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def running(pid: int) -> bool:
    """The process exists and has not exited (a zombie has: its memory and files, GPU memory
    included, are released; only its exit status waits for whoever reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def end_stage(proc: subprocess.Popen, token: str, grace_s: float) -> int:
    """SIGTERM the stage's process group and every process with its token; SIGKILL what is
    left after ``grace_s``; return once all of them have exited (at most 10 s more). Returns
    how many needed SIGKILL."""
    seen = set(token_pids(token))
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    _kill(list(seen), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (proc.poll() is None or token_pids(token)):
        time.sleep(0.2)
    left = token_pids(token)
    seen.update(left)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _kill(left, signal.SIGKILL)
    proc.wait()
    # a process the stage had not started yet at the first look (a launcher's rank starting)
    # is killed too; a killed process gives up its environment (token_pids no longer finds it)
    # a moment before it has closed its files: wait until every one has exited
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        late = token_pids(token)
        _kill(late, signal.SIGKILL)
        seen.update(late)
        if not late and not any(running(p) for p in seen):
            break
        time.sleep(0.1)
    return len(left)


def _trim_log(path: Path) -> None:
    """Keep a log under the device tool's 16 MiB per file: its head and its tail."""
    size = path.stat().st_size
    if size <= LOG_HEAD + LOG_TAIL:
        return
    with path.open("rb") as f:
        head = f.read(LOG_HEAD)
        f.seek(size - LOG_TAIL)
        tail = f.read()
    cut = f"\n[... {size - LOG_HEAD - LOG_TAIL} bytes of this log left out ...]\n".encode()
    path.write_bytes(head + cut + tail)


def _last_progress(out: Path, stage: str, since: float) -> Optional[str]:
    steps = [r for r in report.read(out / report.RESULTS)
             if r.get("kind") == "progress" and r.get("stage") == stage
             and (r.get("t") or 0) >= since]
    return steps[-1]["name"] if steps else None


class Stopped(Exception):
    """The check itself was asked to stop (SIGTERM, SIGINT): the stage in progress is ended."""


def _stop(signum: int, frame: object) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):  # once: the stage's ending is not interrupted
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signal.Signals(signum).name)


def _own_group() -> dict:
    """Popen arguments for a process group of its own, in the check's session: a cut signals
    the group, and whoever ends the check's session (the device tool at its timeout) ends it."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": lambda: os.setpgid(0, 0)}  # pragma: no cover - python 3.10


def run_stage(stage: Stage, cap: float, s: Settings, t0: float) -> dict:
    """The stage in a process group of its own, ended at ``cap`` seconds (or when the check is
    stopped: then its record says so and Stopped goes on); its end record."""
    token = uuid.uuid4().hex
    env = {**s.env(), TOKEN_ENV: token, CAP_ENV: str(cap), report.STAGE_ENV: stage.name,
           report.T0_ENV: str(t0)}
    started = time.time() - t0
    os.environ[report.T0_ENV] = str(t0)
    os.environ[report.STAGE_ENV] = stage.name
    report.append(s.out, {"kind": "stage", "status": "started", "cap_s": round(cap, 1),
                          "what": stage.what, "token": token})
    start = time.monotonic()
    with (s.out / stage.log).open("ab") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--stage",
                                 stage.name], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, **_own_group())
        stopped = None
        try:
            code: Optional[int] = proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            code = None
        except Stopped as e:
            code, stopped = None, e
        killed = end_stage(proc, token, s.grace_s) if code is None else 0
        if code is not None and token_pids(token):  # a finished stage left something running
            killed = end_stage(proc, token, s.grace_s)
    _trim_log(s.out / stage.log)
    record = {"kind": "stage", "cap_s": round(cap, 1),
              "elapsed_s": round(time.monotonic() - start, 1),
              "exit_code": code, "killed": killed}
    if code is None:
        record.update(status="cut", running=_last_progress(s.out, stage.name, started),
                      reason=f"the check was stopped ({stopped})" if stopped
                      else f"over its cap of {cap:.0f} s")
    else:
        record.update(status="done" if code == 0 else "failed",
                      reason=None if code == 0 else f"exit code {code}: see {stage.log}")
    report.append(s.out, record)
    if stopped:
        raise stopped
    return record


def check(s: Settings) -> int:
    """Every stage in order; 0 when each ran to its end."""
    if s.out.exists() and any(s.out.iterdir()):
        raise SystemExit(f"OUT={s.out} is not empty: a check writes into an empty folder "
                         "(nothing of an earlier check is overwritten)")
    s.out.mkdir(parents=True, exist_ok=True)
    s.work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    deadline = time.monotonic() + s.total_s
    for sig in (signal.SIGTERM, signal.SIGINT):  # the stage in progress is ended, then we go
        signal.signal(sig, _stop)
    try:
        worst = _stages(s, t0, deadline)
    except Stopped as e:
        print(f"[gpu-check] stopped ({e}): the stage in progress was ended", flush=True)
        worst = 1
    print(f"\nresults: {s.out / report.RESULTS}\n\n{(s.out / report.SUMMARY).read_text()}")
    return worst


def _stages(s: Settings, t0: float, deadline: float) -> int:
    worst = 0
    for stage in s.stages():
        left = deadline - time.monotonic()
        skip = None
        if stage.name != "setup" and _setup_failed(s):
            skip = "setup failed (the carried wheels or the imports): see setup.log"
        elif left < MIN_LEFT_S:
            skip = f"no time left of TOTAL_S={s.total_s:.0f} s"
        if skip:
            os.environ[report.STAGE_ENV] = stage.name
            report.append(s.out, {"kind": "stage", "status": "skipped", "reason": skip})
            print(f"[gpu-check] {stage.name}: skipped, {skip}", flush=True)
            worst = worst or 1
            continue
        end = run_stage(stage, s.cap(stage, left), s, t0)
        print(f"[gpu-check {time.time() - t0:4.0f} s] {stage.name}: {end['status']} after "
              f"{end['elapsed_s']:.0f} s (cap {end['cap_s']:.0f} s)"
              + (f", {end['reason']}" if end.get("reason") else ""), flush=True)
        worst = worst or int(end["status"] != "done")
    return worst


def _setup_failed(s: Settings) -> bool:
    return any(r.get("kind") == "stage" and r.get("stage") == "setup"
               and r.get("status") in ("failed", "cut")
               for r in report.read(s.out / report.RESULTS))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--stage"]:
        import gpu_check_stages

        return gpu_check_stages.run(argv[1], Settings.from_env())
    if argv:
        raise SystemExit(__doc__)
    return check(Settings.from_env())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
