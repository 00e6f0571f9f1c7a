"""Input written by someone else -- a tokenizer folder with code of its own, files built to crash
or hang a parser -- gets a message before launch, never runs, crashes or hangs the driver
(issue "nothing lost, nothing run, round two")."""
from __future__ import annotations

import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llama_fsdp.run.spec import ConfigError
from tests.conftest import REPO, make_spec

EVIL = '''from pathlib import Path
Path({marker!r}).write_text("ran")
from transformers import PreTrainedTokenizerFast


class EvilTokenizer(PreTrainedTokenizerFast):
    pass
'''


def _project_tokenizer(tmp_path: Path) -> Path:
    """The project tokenizer (trained once, cached), copied where a test may change it."""
    from llama_fsdp.data.synthetic import synthetic_corpus
    from llama_fsdp.data.tokenizer import project_tokenizer_dir

    src = project_tokenizer_dir(REPO / "outputs" / "cache", synthetic_corpus)
    out = tmp_path / "tok"
    shutil.copytree(src, out)
    return out


def _with_remote_code(tok: Path, marker: Path) -> Path:
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "evil.EvilTokenizer"]}
    cfg["tokenizer_class"] = "EvilTokenizer"  # a class transformers does not have
    (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tok / "evil.py").write_text(EVIL.format(marker=str(marker)))
    return tok


def _run_answering_yes(args: list[str], cwd: Path, timeout: float = 240) -> tuple[int, str]:
    """The command on a pseudo-terminal that answers "y" to whatever it asks, as a user who
    trusts the prompt would."""
    main, sub = pty.openpty()
    p = subprocess.Popen(args, cwd=cwd, stdin=sub, stdout=sub, stderr=sub, close_fds=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(sub)
    out, deadline = b"", time.monotonic() + timeout
    while p.poll() is None and time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(main, 65536)
            except OSError:
                break
            out += chunk
            if b"[y/N]" in chunk or b"y/N" in out[-200:]:
                os.write(main, b"y\n")
    if p.poll() is None:
        p.kill()
    p.wait()
    try:
        while select.select([main], [], [], 0.1)[0]:
            chunk = os.read(main, 65536)
            if not chunk:
                break
            out += chunk
    except OSError:
        pass
    os.close(main)
    return p.returncode, out.decode(errors="replace")


def test_a_tokenizer_folder_that_brings_code_is_refused_and_its_code_never_runs(tmp_path):
    """Before: transformers asked on the terminal whether to run the folder's code, and
    answering y ran it in the launcher."""
    marker = tmp_path / "marker"
    tok = _with_remote_code(_project_tokenizer(tmp_path), marker)
    code, out = _run_answering_yes(
        [sys.executable, "-m", "llama_fsdp", "cluster.device=cpu", f"data.tokenizer={tok}",
         "tracking.enabled=false", "train.max_steps=2", "train.warmup_steps=0",
         "eval.every_steps=0", "eval.task_prompts=0"], tmp_path)
    assert not marker.exists(), out[-3000:]
    assert code == 2, out[-3000:]
    assert "tokenizer_config.json names Python classes of its own (auto_map" in out
    assert "never runs a model's or tokenizer's own code" in out


def test_a_model_folder_that_brings_code_is_refused_before_launch(tmp_path):
    from tests.unit.test_bad_input import _tiny_hf

    model = _tiny_hf(tmp_path / "model")
    cfg = json.loads((model / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.Evil"}
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        make_spec(["model=tiny", f"model.path={model}"], output_dir=tmp_path / "run")
    assert "config.json names Python classes of its own (auto_map" in str(e.value)


def test_an_export_never_names_code_to_run(tmp_path):
    """A model.path whose config.json carries auto_map (refused for training) would have
    passed it on to the export: hf_config drops it."""
    from llama_fsdp.checkpoint.hf import hf_config
    from llama_fsdp.config.schema import model_preset
    from tests.unit.test_bad_input import _tiny_hf

    model = _tiny_hf(tmp_path / "model")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoConfig": "x.Y"}}))
    m = model_preset("tiny")
    m.path = str(model)
    out = hf_config(m, dtype="float32").to_dict()
    assert "auto_map" not in out and out["hidden_size"] == cfg["hidden_size"]
