"""Manifests of finished directories (checkpoints, tokenized data, trained tokenizers): every
file with its size, and for caches its SHA-256, written last before the directory is published,
so a missing, truncated or altered file is caught before anything reads it."""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Optional

MANIFEST = "manifest.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(path: Path, *, digests: bool = False) -> None:
    """Record every file under ``path`` with its size (and its SHA-256 with ``digests``)."""
    files = {}
    for f in sorted(Path(path).rglob("*")):
        if f.is_file() and f.name != MANIFEST:
            entry: dict = {"size": f.stat().st_size}
            if digests:
                entry["sha256"] = _sha256(f)
            files[str(f.relative_to(path))] = entry
    (Path(path) / MANIFEST).write_text(json.dumps(files, indent=0))


def verify_manifest(path: Path, *, digests: bool = False,
                    required: bool = False) -> Optional[str]:
    """None if every recorded file is there at its recorded size (and, with ``digests``, its
    recorded SHA-256), else what is wrong, naming the file. A directory without a manifest
    passes unless ``required`` (checkpoints written before manifests existed are not checked)."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return f"{manifest} is missing" if required else None
    try:
        files = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        return f"its {MANIFEST} is unreadable ({e})"
    for name, entry in files.items():
        size = entry if isinstance(entry, int) else entry["size"]  # sizes alone: older manifests
        f = Path(path) / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} has {f.stat().st_size} bytes, {size} were written"
        if digests and isinstance(entry, dict) and "sha256" in entry and _sha256(f) != entry["sha256"]:
            return f"{f} does not match the SHA-256 recorded when it was written"
    return None


def cached_entry_ok(path: Path, *, digests: bool, damaged: Optional[str] = None) -> bool:
    """Whether ``path`` is a complete cache entry (its manifest is there) whose files match the
    manifest. ``damaged``: a caller holding the entry's build lock removes a damaged entry, so
    that it is built again, and logs ``damaged`` with what was wrong (e.g. "the cached
    tokenizer is damaged ({problem}): training it again")."""
    if not (Path(path) / MANIFEST).is_file():
        return False
    problem = verify_manifest(path, digests=digests, required=True)
    if problem is None:
        return True
    if damaged is not None:
        logging.getLogger("llama_fsdp.cache").warning(damaged.format(problem=problem))
        shutil.rmtree(path, ignore_errors=True)
    return False


def not_ours(path: Path, *, edited: bool = True) -> Optional[str]:
    """None when ``path`` holds only the files its manifest lists: wholly what llama_fsdp
    wrote, so it may be replaced or deleted. Else what says otherwise (no manifest, a file it
    does not list), naming it. ``edited``: a listed file whose size changed counts as the
    user's too (an export someone edited); without it, as damage to ours (a checkpoint cut
    short, which a later save of the same step replaces)."""
    manifest = Path(path) / MANIFEST
    problem = verify_manifest(path, required=True)
    if problem is not None and (edited or not manifest.is_file()):
        return problem
    try:
        listed = set(json.loads(manifest.read_text()))
    except (OSError, ValueError) as e:
        return f"its {MANIFEST} is unreadable ({e})"
    extra = sorted(str(f.relative_to(path)) for f in Path(path).rglob("*")
                   if f.is_file() and f.name != MANIFEST and str(f.relative_to(path)) not in listed)
    if extra:
        return f"{Path(path) / extra[0]} is not one of the files llama_fsdp wrote there"
    return None
