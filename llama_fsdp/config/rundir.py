"""Every path inside a run directory, in one place (no torch, no heavy imports: the CLI, the
launchers' rank supervisors and the worker all read it).

A run directory (``outputs/runs/<date>/<time>``, or ``output_dir=``) holds::

    config.yaml         the resolved config of the latest launch
    run_status.json     how the latest attempt ended, with its config's digest
    run_identity.json   which run trains here (an id made when it started) and its config's
                        digest; every checkpoint it saves carries the same (run.json)
    owner.json          the live launcher that owns the directory (host, pid, since)
    owner.lock          the lock that launcher holds (kept: it marks the directory as a run's)
    checkpoints/        DCP checkpoints: step_000010/ (published), step_000020.tmp/ (in flight);
                        retired/<time>/: an earlier run's, moved aside by resume=retire
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
# cache_dir's default where set (one cache for runs launched from several folders), else CACHE
CACHE_ENV = "LLAMA_FSDP_CACHE_DIR"
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
RUN_IDENTITY = "run_identity.json"
RETIRED = "retired"  # under checkpoints/: an earlier run's checkpoints, moved aside
HF_META = "hf"  # inside a DCP checkpoint: config.json (+ tokenizer) for convert / export
CHECKPOINT_RUN = "run.json"  # inside a DCP checkpoint: the run that saved it (its identity)
OPTIM_META = "optimizer.json"  # inside a DCP checkpoint: the optimizer that wrote its state


# What only a run writes: a directory holding one of these is a run directory, which a run may
# write into (``claim_problem``). config.yaml alone is no proof: users name their files so too.
RUN_MARKERS = (OWNER_LOCK, OWNER, RUN_STATUS, RUN_IDENTITY, f"{TRACKING}/run.json")


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
    def identity(self) -> Path:
        return self.root / RUN_IDENTITY

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def retired(self) -> Path:
        return self.checkpoints / RETIRED

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


def write_identity(output_dir: str | Path, *, run: str, config_yaml: str) -> None:
    """The run that trains in ``output_dir``: its id and its config's digest."""
    replace_text(RunDir(output_dir).identity,
                 json.dumps({"run": run, "config_sha256": config_digest(config_yaml)}))


def read_identity(output_dir: str | Path) -> dict:
    """The run directory's run_identity.json ({} without one)."""
    return _read_json(RunDir(output_dir).identity)


def _read_json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def read_run_status(output_dir: str | Path) -> dict:
    """run_status.json as a dict ({} when there is none or it cannot be read)."""
    try:
        return json.loads(RunDir(output_dir).status.read_text())
    except (OSError, ValueError):
        return {}


def name_problem(key: str, name: str) -> "str | None":
    """Why ``name`` cannot be one folder's name inside another (a separator, `..`, a NUL): a
    name that becomes a path must not leave the folder it is put in."""
    if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        return (f"{key}={name!r} becomes a folder name, and it would not stay one folder inside "
                "its parent: use a name without '/', '\\' or '..'")
    return None


def claim_problem(output_dir: str | Path) -> "str | None":
    """None when a run may write into ``output_dir``: it does not exist yet, it is empty, or it
    is a run directory (it holds one of RUN_MARKERS). Else what is there, for the refusal: a
    run overwrites config.yaml and run_status.json and replaces export/, which must never be
    done to a folder of the user's."""
    root = Path(output_dir)
    if not root.exists():
        return None
    if not root.is_dir():
        return f"output_dir={root} is a file, not a directory"
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir())
    if not entries or any((root / m).exists() for m in RUN_MARKERS):
        return None
    shown = ", ".join(entries[:8]) + (f" and {len(entries) - 8} more" if len(entries) > 8 else "")
    return (f"output_dir={root} is not empty and is not a llama_fsdp run directory (it holds "
            f"{shown}): a run writes config.yaml, run_status.json, checkpoints/ and export/ "
            "there and would overwrite what is yours. Give an empty or new directory, or the "
            "directory of an earlier run to continue it")


def unwritable(key: str, path: str | Path, fix: str) -> "str | None":
    """Why a folder cannot be made (or written) at ``path``, checked before any work: its
    deepest existing part is a file, on a read-only mount, or not the user's to write. None when
    it can be. ``fix`` ends the message (what to give instead)."""
    import os

    where = Footprint.deepest_existing(Path(path).expanduser())
    if not where.is_dir():
        why = f"{where} is a file, not a folder"
    elif os.access(where, os.W_OK | os.X_OK):
        return None
    elif os.statvfs(where).f_flag & os.ST_RDONLY:
        why = f"{where} is on a read-only mount"
    else:
        why = f"{where} is not writable by this user"
    return f"{key}={path} cannot be made: {why}. Pick a writable folder: {fix}"


class Footprint:
    """What of a run directory's path existed before this launch, so that a launch that does
    not happen removes exactly the empty directories it made and the lock it took, and never
    a directory (or lock) that was there before it."""

    def __init__(self, path: str | Path, *, existed: "Path | None" = None):
        self.path = Path(path).absolute()
        # the deepest directory of the path that was there before (None: record it now)
        self.existed = existed if existed is not None else self.deepest_existing(self.path)
        self.had_lock = (self.path / OWNER_LOCK).exists()

    @staticmethod
    def deepest_existing(path: Path) -> Path:
        path = Path(path).absolute()
        return next(p for p in (path, *path.parents) if p.exists())

    def undo(self) -> None:
        """Remove the lock this launch left in a directory that holds nothing else, then the
        empty directories it made, deepest first (rmdir: never one that holds anything)."""
        lock = self.path / OWNER_LOCK
        if not self.had_lock and self.path.is_dir() and \
                [p.name for p in self.path.iterdir()] == [OWNER_LOCK]:
            lock.unlink(missing_ok=True)
        for d in (self.path, *self.path.parents):
            if d == self.existed or d in self.existed.parents:
                return
            try:
                d.rmdir()
            except OSError:
                return


def private_dir(path: str | Path) -> Path:
    """``path`` as a directory only its owner can read: the pickled run (submitit's job file,
    a rank's input) holds the run's resolved values, those of ${oc.env:...} keys included."""
    import os

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path
