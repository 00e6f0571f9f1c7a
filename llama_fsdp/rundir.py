"""Every path inside a run directory, in one place (no torch, no heavy imports: the CLI, the
launchers' rank supervisors and the worker all read it).

A run directory (``outputs/runs/<date>/<time>``, or ``output_dir=``) holds::

    config.yaml         the resolved config of the latest launch
    run_status.json     how the latest attempt ended, with its config's digest
    owner.json          the live launcher that owns the directory (host, pid, since)
    owner.lock          the flock its owner holds (the kernel lets it go when the owner dies)
    checkpoints/        DCP checkpoints: step_000010/ (published), step_000020.tmp/ (in flight)
    export/             the consolidated HF directory (save.export_hf), or the PEFT adapter
                        (finetune=lora / qlora)
    export_merged/      the base with the adapters merged in (finetune.export_merged)
    tracking/           rank 0's MLflow events: spool.jsonl, how far they are delivered
                        (shipped), run.json (the store and the MLflow run id), ship.lock
    launch/             per attempt, <job>.<requeue>.<attempt>/: a failed rank's report
                        rank<r>.json, and rank<r>.in / .out / .traceback, what its supervisor
                        and worker exchange
    submitit/           submitit's job folders and the ranks' logs
    hang/               every thread's stack of a rank whose collective hung

A sweep directory (``outputs/sweeps/<date>/<time>``) has a tracking/ of its own (the parent run).
Below the launch directory, ``OUTPUT_ROOTS`` are where runs, sweeps, the default MLflow store and
the caches go.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

# The launch directory's outputs/ (ignored by git)
OUTPUTS = "outputs"
RUNS = f"{OUTPUTS}/runs"  # run directories: <date>/<time>, or torchrun-<run id>
SWEEPS = f"{OUTPUTS}/sweeps"  # sweep directories: <date>/<time>, one folder per point
MLFLOW_DB = f"{OUTPUTS}/mlflow.db"  # the default MLflow store (tracking.uri)
CACHE = f"{OUTPUTS}/cache"  # tokenizers, tokenized data, compiled optimizer steps (cache_dir)
OUTPUT_ROOTS = {"runs": RUNS, "sweeps": SWEEPS, "mlflow": MLFLOW_DB, "cache": CACHE}

CONFIG_FILE = "config.yaml"
RUN_STATUS = "run_status.json"
OWNER = "owner.json"
OWNER_LOCK = "owner.lock"
CHECKPOINTS = "checkpoints"
EXPORT = "export"
EXPORT_MERGED = "export_merged"
TRACKING = "tracking"
SPOOL, SHIPPED, RUN_FILE, SHIP_LOCK = "spool.jsonl", "shipped", "run.json", "ship.lock"
LAUNCH = "launch"
SUBMITIT = "submitit"
HANG = "hang"
HF_META = "hf"  # inside a DCP checkpoint: config.json (+ tokenizer) for convert / export
OPTIM_META = "optimizer.json"  # inside a DCP checkpoint: the optimizer that wrote its state


class RunDir:
    """The paths of one run directory (nothing is created by asking)."""

    def __init__(self, output_dir: str | Path):
        self.root = Path(output_dir)

    def __fspath__(self) -> str:
        return str(self.root)

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def status(self) -> Path:
        return self.root / RUN_STATUS

    @property
    def owner(self) -> Path:
        return self.root / OWNER

    @property
    def owner_lock(self) -> Path:
        return self.root / OWNER_LOCK

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def export(self) -> Path:
        return self.root / EXPORT

    @property
    def export_merged(self) -> Path:
        return self.root / EXPORT_MERGED

    @property
    def tracking(self) -> Path:
        return self.root / TRACKING

    @property
    def spool(self) -> Path:
        return self.tracking / SPOOL

    @property
    def shipped(self) -> Path:
        return self.tracking / SHIPPED

    @property
    def run_file(self) -> Path:
        return self.tracking / RUN_FILE

    @property
    def ship_lock(self) -> Path:
        return self.tracking / SHIP_LOCK

    @property
    def launch(self) -> Path:
        return self.root / LAUNCH

    @property
    def submitit(self) -> Path:
        return self.root / SUBMITIT

    @property
    def hang(self) -> Path:
        return self.root / HANG

    def hang_file(self, rank: int) -> Path:
        """Where a rank's thread stacks go when a step outlives the training timeout."""
        return self.hang / f"rank{rank}.txt"

    @property
    def nccl_trace_prefix(self) -> str:
        """NCCL's flight recorder dumps here, one file per rank (TORCH_FR_DUMP_TEMP_FILE)."""
        return str(self.hang / "nccl_trace_rank_")

    def attempt(self, job_id: str, requeue: int, attempt: int) -> Path:
        """One attempt's rank reports (a SLURM requeue, a restart after a failed rank)."""
        return self.launch / f"{job_id}.{requeue}.{attempt}"


def report_path(directory: Path, rank: int | str) -> Path:
    """Where a failed rank's report is written in an attempt's folder (one per rank per
    attempt; rank "*" globs them)."""
    return Path(directory) / f"rank{rank}.json"


def exchange_files(directory: Path, rank: int) -> dict[str, Path]:
    """What a rank's supervisor and its worker exchange in an attempt's folder: "in" (the
    pickled entry point and spec), "out" (the pickled result), "traceback"."""
    return {k: Path(directory) / f"rank{rank}.{k}" for k in ("in", "out", "traceback")}


def replace_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def config_digest(config_yaml: str) -> str:
    """The identity of a resolved config (run_status.json records the one that finished)."""
    return hashlib.sha256(config_yaml.encode()).hexdigest()


def write_run_status(output_dir: str | Path, *, status: str, step: int, config_yaml: str) -> None:
    """How this attempt ended, and with which resolved config (config.yaml is rewritten by
    every attempt, also by one that dies before it trains)."""
    replace_text(RunDir(output_dir).status,
                 json.dumps({"status": status, "step": step,
                             "config_sha256": config_digest(config_yaml)}))


def read_run_status(output_dir: str | Path) -> dict:
    """run_status.json as a dict ({} when there is none or it cannot be read)."""
    try:
        return json.loads(RunDir(output_dir).status.read_text())
    except (OSError, ValueError):
        return {}
