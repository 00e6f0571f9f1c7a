"""Checkpoint directories of a run: names, completeness, retention (no torch, no I/O beyond
listing and deleting them).

Saves are write-then-publish: ranks write ``step_N.tmp``; after every rank has finished, rank 0
renames it to ``step_N``. Only directories named ``step_N`` that hold DCP's ``.metadata`` count
as checkpoints, so a run killed mid-save leaves the previous one to resume from.

Each checkpoint names the run that saved it (``run.json``: the id in the run directory's
run_identity.json). Retention prunes only the run's own checkpoints, and resume=auto continues
the run of the newest one; an earlier run's are never deleted by a later one (a new run into a
directory that holds them is refused before launch, or moves them aside: ``retire``).
Checkpoints written before runs had ids belong to whichever run continues them.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Optional

from ..config import manifest
from ..config.manifest import MANIFEST  # noqa: F401 - a checkpoint's file list, written last
from ..config.rundir import CHECKPOINT_RUN, CHECKPOINTS, RunDir, replace_text

METADATA = ".metadata"  # DCP writes it last, on rank 0: its presence marks a complete write
TMP_SUFFIX = ".tmp"
_STEP_RE = re.compile(r"^step_(\d{6,})$")


def step_dir(output_dir: str | Path, step: int) -> Path:
    return RunDir(output_dir).checkpoints / f"step_{step:06d}"


def is_checkpoint(path: Path) -> bool:
    """A published, complete DCP checkpoint (not a ``.tmp`` left by an interrupted save)."""
    return bool(_STEP_RE.match(path.name)) and (path / METADATA).is_file()


def checkpoint_run(path: Path) -> Optional[str]:
    """The id of the run that saved a checkpoint (None for one saved before runs had ids)."""
    try:
        run = json.loads((path / CHECKPOINT_RUN).read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        return None
    return run if isinstance(run, str) else None


def write_checkpoint_run(path: Path, identity: dict) -> None:
    """Name the run that saves the checkpoint being written at ``path``."""
    replace_text(path / CHECKPOINT_RUN, json.dumps(identity))


def list_checkpoints(output_dir: str | Path, *, run: Optional[str] = None
                     ) -> list[tuple[int, Path]]:
    """Complete checkpoints in a run directory, oldest first; with ``run``, only that run's (and
    those saved before runs had ids)."""
    root = RunDir(output_dir).checkpoints
    if not root.is_dir():
        return []
    found = [(int(_STEP_RE.match(p.name).group(1)), p) for p in root.iterdir()  # type: ignore[union-attr]
             if is_checkpoint(p)]
    if run is not None:
        found = [(s, p) for s, p in found if checkpoint_run(p) in (run, None)]
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def resolve_resume(resume: str, output_dir: str | Path, *, named: str = "resume=") -> Optional[Path]:
    """``auto``: newest checkpoint of this run (or None); ``none``: None; else a checkpoint
    directory, or a run directory whose newest checkpoint is taken. ``named``: how the error
    names the argument (the convert command's is a positional path)."""
    match resume:
        case "none" | "retire":
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
        newest = latest_checkpoint(output_dir)
        run = checkpoint_run(newest) if newest is not None else None
        return [p for _, p in reversed(list_checkpoints(output_dir, run=run))]
    path = resolve_resume(resume, output_dir)
    return [path] if path is not None else []


def continued_run(resume: str, output_dir: str | Path) -> Optional[str]:
    """The id of the run that a launch continues in ``output_dir``: the run of the checkpoint it
    resumes from, when that checkpoint is this directory's own and has an id; None for a new
    run (nothing to resume, resume=none / retire, another directory's checkpoint)."""
    try:
        candidates = resume_candidates(resume, output_dir)
    except (FileNotFoundError, OSError):
        return None
    own = RunDir(output_dir).checkpoints.resolve()
    if not candidates or candidates[0].resolve().parent != own:
        return None
    return checkpoint_run(candidates[0])


def others(output_dir: str | Path) -> list[Path]:
    """The complete checkpoints in a run directory: what a new run there would share it with."""
    return [p for _, p in list_checkpoints(output_dir)]


def retire(output_dir: str | Path) -> Optional[Path]:
    """Move every checkpoint of ``output_dir`` (complete or not) into checkpoints/retired/<time>/,
    where nothing of llama_fsdp reads or prunes them; the folder they went to (None: none)."""
    found = others(output_dir) + interrupted(output_dir)
    if not found:
        return None
    dest = RunDir(output_dir).retired / time.strftime("%Y%m%d-%H%M%S")
    while dest.exists():
        dest = dest.with_name(dest.name + "_")
    dest.mkdir(parents=True)
    for path in found:
        path.rename(dest / path.name)
    return dest


def verify(path: Path) -> Optional[str]:
    """None if the checkpoint's files are all there at their written sizes, else what is
    wrong (checkpoints written before manifests existed are not checked)."""
    return manifest.verify_manifest(path)


def expired(output_dir: str | Path, keep_last: int, *, run: Optional[str] = None) -> list[Path]:
    """The run's complete checkpoints older than its newest ``keep_last`` (what retention
    deletes); ``run``: its id (another run's checkpoints are never among them)."""
    own = list_checkpoints(output_dir, run=run)
    return [p for _, p in own[:-keep_last]] if keep_last > 0 else []


def interrupted(output_dir: str | Path) -> list[Path]:
    """``step_N.tmp`` directories: saves that never completed (never read, deleted on save)."""
    root = RunDir(output_dir).checkpoints
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"step_*{TMP_SUFFIX}")
                  if _STEP_RE.match(p.name[: -len(TMP_SUFFIX)]))


def _remove(path: Path, root: Path, *, published: bool = False) -> bool:
    """Delete a checkpoint directory, refusing anything that is not directly under root. A
    ``published`` one (step_N, not an in-flight step_N.tmp) goes only when it is wholly what
    llama_fsdp wrote (its manifest lists every file; a file cut short is damage to ours): else
    it stays, with a warning naming what is not ours, and False is returned."""
    if path.parent.resolve() != root.resolve():
        raise RuntimeError(f"refusing to delete {path}: not inside {root}")
    if path.is_symlink():
        path.unlink()
    elif published and path.exists() and (why := manifest.not_ours(path, edited=False)):
        import logging

        logging.getLogger(__name__).warning(
            "keeping %s: it holds what llama_fsdp did not write (%s); move it away to let "
            "save.keep_last prune it", path, why)
        return False
    elif path.exists():
        shutil.rmtree(path)
    return True


PARTIAL = ".llama_fsdp_partial"  # inside a directory being written, until it is published


class ExportExists(FileExistsError):
    """An export would replace a directory that is not wholly llama_fsdp's own."""


def scratch_dir(out: Path) -> Path:
    """An empty directory beside ``out`` to write it in, marked as ours while it is written:
    ``<out>.tmp`` (a partial one left by an interrupted write is ours and replaced; anything
    else of that name is left alone and a fresh name is taken)."""
    import tempfile

    tmp = out.with_name(out.name + TMP_SUFFIX)
    if tmp.is_dir() and not tmp.is_symlink() and (tmp / PARTIAL).is_file():
        shutil.rmtree(tmp)
    if tmp.exists() or tmp.is_symlink():
        tmp = Path(tempfile.mkdtemp(prefix=tmp.name + "-", dir=out.parent))
    else:
        tmp.mkdir(parents=True)
    (tmp / PARTIAL).touch()
    return tmp


def export_problem(out: Path) -> Optional[str]:
    """None when a directory may be written at ``out``: nothing is there, an empty directory,
    or an earlier export of llama_fsdp's (its manifest lists every file). Else why not."""
    if not out.exists() and not out.is_symlink():
        return None
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return None
    if out.is_dir() and not out.is_symlink() and manifest.not_ours(out) is None:
        return None
    why = manifest.not_ours(out) if out.is_dir() and not out.is_symlink() else "not a directory"
    return (f"{out} exists and is not an export llama_fsdp wrote ({why}); it is left as it is. "
            "Move it away (or choose another output directory)")


def publish_dir(tmp: Path, out: Path, *, overwrite: bool = False) -> Path:
    """Put the finished ``tmp`` (scratch_dir) in place as ``out``, with its manifest. What is
    at ``out`` is replaced only when ``overwrite`` (the user asked) or it is empty or an earlier
    export of ours (export_problem); else ExportExists, and ``tmp`` is removed."""
    (tmp / PARTIAL).unlink(missing_ok=True)
    manifest.write_manifest(tmp)
    if not overwrite and (problem := export_problem(out)) is not None:
        shutil.rmtree(tmp)
        raise ExportExists(problem)
    if out.is_symlink() or out.is_file():
        out.unlink()
    elif out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

