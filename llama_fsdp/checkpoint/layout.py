"""Checkpoint directories of a run: names, completeness, retention (no torch, no I/O beyond
listing and deleting them).

Saves are write-then-publish: ranks write ``step_N.tmp``; after every rank has finished, rank 0
renames it to ``step_N``. Only directories named ``step_N`` that hold DCP's ``.metadata`` count
as checkpoints, so a run killed mid-save leaves the previous one to resume from.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

from .. import manifest
from ..manifest import MANIFEST  # noqa: F401 - a checkpoint's file list, written last
from ..rundir import CHECKPOINTS, RunDir

METADATA = ".metadata"  # DCP writes it last, on rank 0: its presence marks a complete write
TMP_SUFFIX = ".tmp"
_STEP_RE = re.compile(r"^step_(\d{6,})$")


def step_dir(output_dir: str | Path, step: int) -> Path:
    return RunDir(output_dir).checkpoints / f"step_{step:06d}"


def is_checkpoint(path: Path) -> bool:
    """A published, complete DCP checkpoint (not a ``.tmp`` left by an interrupted save)."""
    return bool(_STEP_RE.match(path.name)) and (path / METADATA).is_file()


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first."""
    root = RunDir(output_dir).checkpoints
    if not root.is_dir():
        return []
    found = [(int(_STEP_RE.match(p.name).group(1)), p) for p in root.iterdir()  # type: ignore[union-attr]
             if is_checkpoint(p)]
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def resolve_resume(resume: str, output_dir: str | Path, *, named: str = "resume=") -> Optional[Path]:
    """``auto``: newest checkpoint of this run (or None); ``none``: None; else a checkpoint
    directory, or a run directory whose newest checkpoint is taken. ``named``: how the error
    names the argument (the convert command's is a positional path)."""
    match resume:
        case "none":
            return None
        case "auto":
            return latest_checkpoint(output_dir)
    path = Path(resume).expanduser().resolve()
    if is_checkpoint(path) or (path / METADATA).is_file():
        return path
    newest = latest_checkpoint(path)
    if newest is None:
        raise FileNotFoundError(f"{named}{resume}: neither a DCP checkpoint (no {METADATA}) nor a "
                                f"run directory with complete checkpoints under {CHECKPOINTS}/")
    return newest


def resume_candidates(resume: str, output_dir: str | Path) -> list[Path]:
    """The checkpoints ``resume`` allows, the one to try first first: for ``auto`` every
    complete checkpoint of the run, newest first (an unreadable newest one falls back to the one
    before); otherwise the one checkpoint resolve_resume names."""
    if resume == "auto":
        return [p for _, p in reversed(list_checkpoints(output_dir))]
    path = resolve_resume(resume, output_dir)
    return [path] if path is not None else []


def verify(path: Path) -> Optional[str]:
    """None if the checkpoint's files are all there at their written sizes, else what is
    wrong (checkpoints written before manifests existed are not checked)."""
    return manifest.verify_manifest(path)


def expired(output_dir: str | Path, keep_last: int) -> list[Path]:
    """Complete checkpoints older than the newest ``keep_last`` (what retention deletes)."""
    return [p for _, p in list_checkpoints(output_dir)[:-keep_last]] if keep_last > 0 else []


def interrupted(output_dir: str | Path) -> list[Path]:
    """``step_N.tmp`` directories: saves that never completed (never read, deleted on save)."""
    root = RunDir(output_dir).checkpoints
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"step_*{TMP_SUFFIX}")
                  if _STEP_RE.match(p.name[: -len(TMP_SUFFIX)]))


def _remove(path: Path, root: Path) -> None:
    """Delete a checkpoint directory, refusing anything that is not directly under root."""
    if path.parent.resolve() != root.resolve():
        raise RuntimeError(f"refusing to delete {path}: not inside {root}")
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

