"""Nothing of the user's is lost: a run writes only into an empty directory, one it made, or one
of its own run directories; a run that does not launch removes only what it made; an export or
a retention sweep never deletes what llama_fsdp did not write."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from llama_fsdp.checkpoint import hf, layout
from llama_fsdp.config.manifest import write_manifest
from llama_fsdp.run.spec import ConfigError
from tests.conftest import make_spec
from tests import warm

QUICK = ["cluster.device=cpu", "tracking.enabled=false", "train.max_steps=2",
         "train.warmup_steps=1", "eval.every_steps=0", "eval.task_prompts=0"]


def _cli(cwd: Path, *overrides: str) -> tuple[int, str]:
    out = subprocess.run([warm.python(), "-m", "llama_fsdp", *QUICK, *overrides], cwd=cwd,
                         capture_output=True, text=True, timeout=300)
    return out.returncode, out.stdout + out.stderr


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(root.rglob("*"))}


def test_a_folder_of_the_users_is_refused_before_launch_naming_what_is_there(tmp_path):
    """Before: the run overwrote config.yaml there, wrote run_status.json, and replaced export/
    with the user's file in it."""
    mine = tmp_path / "mine"
    (mine / "export").mkdir(parents=True)
    (mine / "export" / "weights.bin").write_bytes(b"\x00users")
    (mine / "config.yaml").write_text("my: own\n")
    (mine / "notes.txt").write_text("notes")
    before = _snapshot(mine)
    code, log = _cli(tmp_path, f"output_dir={mine}", "save.export_hf=true")
    assert code == 2, log[-3000:]
    assert f"output_dir={mine} is not empty and is not a llama_fsdp run directory" in log
    assert "config.yaml, export/, notes.txt" in log
    assert _snapshot(mine) == before  # not one byte, not one new file (no owner.lock either)
    assert not (tmp_path / "outputs").exists()  # Hydra's unused run dir is gone too


def test_a_run_that_does_not_launch_leaves_the_users_directories_and_removes_its_own(tmp_path):
    """Before: a refused run (and a dry run) removed an empty output_dir the user had made, and
    a dry run with output_dir= left an empty outputs/runs/<date>/<time> behind."""
    empty = tmp_path / "empty"
    empty.mkdir()
    from llama_fsdp.launchers.environment import free_port

    # refused after it took the directory (the store is reached after the lock is taken)
    code, log = _cli(tmp_path, f"output_dir={empty}", "tracking.enabled=true",
                     f"tracking.uri=http://127.0.0.1:{free_port()}")
    assert code == 2 and "does not answer" in log, log[-3000:]
    assert empty.is_dir() and not any(empty.iterdir())  # kept, and its lock taken back
    code, log = _cli(tmp_path, f"output_dir={empty}/a/b", "train.lr=-1")  # refused at compose
    assert code == 2 and "train.lr=-1.0 must be > 0" in log, log[-3000:]
    assert empty.is_dir() and not any(empty.iterdir())  # a/b made, and removed; empty kept
    code, log = _cli(tmp_path, f"output_dir={empty}", "dry_run=true")
    assert code == 0, log[-3000:]
    assert empty.is_dir() and not any(empty.iterdir())
    assert not (tmp_path / "outputs").exists()  # nor Hydra's own run dir, nor its parents


def test_a_run_directory_is_taken_again_and_its_layout_is_the_proof(tmp_path):
    from llama_fsdp.config.rundir import RUN_MARKERS, claim_problem

    assert claim_problem(tmp_path / "new") is None and claim_problem(tmp_path) is None
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("a: 1\n")
    assert "it holds config.yaml" in claim_problem(run)  # a config.yaml alone proves nothing
    for marker in RUN_MARKERS:
        (run / marker).parent.mkdir(parents=True, exist_ok=True)
        (run / marker).write_text("{}")
        assert claim_problem(run) is None, marker
        (run / marker).unlink()


def _export(out: Path) -> Path:
    sd = {"w": torch.arange(6.0).reshape(2, 3)}
    from transformers import LlamaConfig

    return hf.write_hf_dir(sd, out, config=LlamaConfig(vocab_size=8, hidden_size=8,
                                                       intermediate_size=8, num_hidden_layers=1,
                                                       num_attention_heads=2))


def test_an_export_replaces_only_an_export_of_its_own(tmp_path):
    """Before: shutil.rmtree of whatever was at <run>/export (checkpoint/hf.py, adapters.py)."""
    out = tmp_path / "export"
    _export(out)
    assert (out / "manifest.json").is_file()
    _export(out)  # a second export of the same run replaces the first: it is provably ours
    (out / "mine.txt").write_text("the user's")
    with pytest.raises(layout.ExportExists, match="mine.txt is not one of the files"):
        _export(out)
    assert (out / "mine.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no scratch dir left
    (out / "mine.txt").unlink()
    (out / "config.json").write_text("{}")  # an export of ours, changed by hand: kept too
    with pytest.raises(layout.ExportExists, match="config.json has"):
        _export(out)
    # a directory of the user's named like the scratch dir is left alone
    (tmp_path / "e2.tmp").mkdir()
    (tmp_path / "e2.tmp" / "keep").write_text("k")
    _export(tmp_path / "e2")
    assert (tmp_path / "e2.tmp" / "keep").read_text() == "k" and (tmp_path / "e2").is_dir()


def test_an_export_over_the_users_files_is_refused_before_launch(tmp_path):
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "owner.lock").touch()
    (run / "export" / "mine.safetensors").write_bytes(b"x")
    make_spec(["save.export_hf=false"], output_dir=run)  # no export: nothing to refuse
    with pytest.raises(ConfigError, match=r"export would replace what is there: .*export exists "
                                          r"and is not an export llama_fsdp wrote"):
        make_spec(["save.export_hf=true"], output_dir=run)


def test_retention_deletes_only_checkpoints_wholly_its_own(tmp_path, caplog):
    root = tmp_path / "run" / layout.CHECKPOINTS
    ours, theirs = root / "step_000002", root / "step_000004"
    for d in (ours, theirs):
        d.mkdir(parents=True)
        (d / layout.METADATA).write_bytes(b"m")
        write_manifest(d)
    (theirs / "notes.txt").write_text("mine")
    (ours / layout.METADATA).write_bytes(b"")  # damaged (cut short): still ours to prune
    assert layout._remove(ours, root, published=True) and not ours.exists()
    assert not layout._remove(theirs, root, published=True)
    assert (theirs / "notes.txt").read_text() == "mine"
    assert "notes.txt is not one of the files llama_fsdp wrote" in caplog.text
