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
import time
from pathlib import Path

import pytest

from llama_fsdp.run.spec import ConfigError
from tests import warm
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
        [warm.python(), "-m", "llama_fsdp", "cluster.device=cpu", f"data.tokenizer={tok}",
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


# --- files built to crash or hang a parser ------------------------------------------------------


def test_json_nested_past_any_record_is_named_before_a_parser_sees_it(tmp_path):
    """Before: a record nested 100,000 levels deep segfaulted the launcher (exit 139) with no
    message, and left owner.json and owner.lock behind."""
    deep = tmp_path / "deep.jsonl"
    d = 100_000
    deep.write_text('{"instruction": "a", "input": "", "output": "b"}\n' * 20
                    + '{"instruction": "x", "input": ' + "[" * d + "]" * d + ', "output": "y"}\n')
    r = subprocess.run([warm.python(), "-m", "llama_fsdp", "cluster.device=cpu", "data=jsonl",
                        f"data.path={deep}", "tracking.enabled=false", "train.max_steps=2",
                        "train.warmup_steps=0", f"output_dir={tmp_path / 'run'}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert f"{deep}: line 21: JSON nested more than 100 levels deep" in out
    assert not (tmp_path / "run").exists()  # a refused launch leaves nothing of its own


def test_a_json_string_of_brackets_is_no_nesting(tmp_path):
    from llama_fsdp.data.sources import _too_deep

    f = tmp_path / "ok.jsonl"
    f.write_text(json.dumps({"instruction": "[" * 500 + '\\"{' * 300, "output": "]" * 900}) + "\n")
    assert json.loads(f.read_text())["output"] == "]" * 900
    assert _too_deep(str(f)) is None


@pytest.mark.timeout(120)
def test_a_chat_template_that_never_ends_is_stopped_with_a_message(tmp_path, monkeypatch):
    """Before: two nested 100,000-step loops hung data preparation at 100% CPU (this test then
    runs into its timeout)."""
    from llama_fsdp.config.schema import DataConfig
    from llama_fsdp.data import build_data, formats

    monkeypatch.setattr(formats, "RENDER_BUDGET_S", 1.0, raising=False)
    chats = tmp_path / "chat.jsonl"
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}) + "\n"
        for i in range(8)))
    endless = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
               "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    cfg = DataConfig(name="jsonl", path=str(chats), format="chat", chat_template=endless,
                     eval_records=1)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="the chat template ran for more than 1 s on one "
                                         "conversation"):
        build_data(cfg, seq_len=64, micro_batch=2, dp_rank=0, dp_world=1, seed=0,
                   cache_dir=tmp_path / "cache", vocab_size=512)
    assert time.monotonic() - t0 < 60


def _safetensors(path: Path, header: dict, data: bytes) -> Path:
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)
    return path


@pytest.mark.parametrize("header,data,why", [
    ({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}}, b"\0" * 32,
     "w: F32 [4, 4] is 64 bytes but its offsets span 32"),
    ({"a": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]},
      "b": {"dtype": "F16", "shape": [4], "data_offsets": [4, 12]}}, b"\0" * 12,
     "b: its data starts at byte 4, not where the tensor before it ends (8): overlapping"),
    ({"w": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 2]}}, b"\0" * 2,
     "w: unknown dtype 'Q4'"),
    ({"w": {"dtype": "U8", "shape": [2, -1], "data_offsets": [0, 2]}}, b"\0" * 2,
     "w: shape [2, -1] is not a list of sizes"),
], ids=["bytes-of-shape", "overlapping", "dtype", "negative-size"])
def test_a_safetensors_header_that_lies_is_named_without_torch(tmp_path, header, data, why):
    from llama_fsdp.config.hf_dir import safetensors_problem

    f = _safetensors(tmp_path / "model.safetensors", header, data)
    problem = safetensors_problem(f)
    assert problem is not None and why in problem, problem


def test_weights_whose_shapes_are_not_config_jsons_are_refused_before_launch(tmp_path):
    from safetensors.numpy import save_file
    import numpy as np

    from tests.unit.test_bad_input import _tiny_hf

    model = _tiny_hf(tmp_path / "model")
    cfg = json.loads((model / "config.json").read_text())
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    for f in model.glob("*.safetensors*"):
        f.unlink()
    save_file({"model.embed_tokens.weight": np.zeros((2 * v, h), np.float32),
               "model.layers.0.mlp.down_proj.weight":
                   np.zeros((cfg["intermediate_size"], h), np.float32)},
              str(model / "model.safetensors"))
    with pytest.raises(ConfigError) as e:
        make_spec(["model=tiny", f"model.path={model}"], output_dir=tmp_path / "run")
    text = str(e.value)
    assert f"model.embed_tokens.weight has shape ({2 * v}, {h}), but config.json gives it " \
           f"({v}, {h})" in text
    assert "model.layers.0.mlp.down_proj.weight has shape" in text  # transposed


def test_a_config_json_value_of_the_wrong_kind_is_named_as_such(tmp_path):
    """Before: a string "256" was compared with 256 ("256 but config.json has 256") and the
    fixes suggested model.hidden_size=256 again."""
    from tests.unit.test_bad_input import _tiny_hf

    model = _tiny_hf(tmp_path / "model")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "hidden_size": str(cfg["hidden_size"]),
                                                   "num_hidden_layers": 1e9}))
    with pytest.raises(ConfigError) as e:
        make_spec(["model=tiny", f"model.path={model}"], output_dir=tmp_path / "run")
    text = str(e.value)
    assert f"hidden_size is a str ('{cfg['hidden_size']}'), not a whole number" in text
    assert "num_hidden_layers is a float (1000000000.0), not a whole number" in text
    assert "=1000000000.0" not in text.split("not a whole number")[-1]


# --- the user's database, names MLflow takes ----------------------------------------------------


def test_a_users_sqlite_database_is_refused_and_left_byte_for_byte(tmp_path):
    """Before: tracking.uri at the user's own SQLite file gained about 60 MLflow tables, and an
    mlartifacts/ folder appeared beside it."""
    import sqlite3

    from llama_fsdp.tracking.store import NotAStore, open_client

    db = tmp_path / "mine.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER, total REAL)")
        conn.execute("INSERT INTO invoices VALUES (1, 9.5)")
    conn.close()
    before = db.read_bytes()
    with pytest.raises(ConfigError) as e:
        make_spec([f"tracking.uri=sqlite:///{db}"], output_dir=tmp_path / "run")
    assert "a SQLite database that is not an MLflow store (its tables: invoices)" in str(e.value)
    with pytest.raises(NotAStore):
        open_client(f"sqlite:///{db}")
    assert db.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.db"]  # no .lock, no mlartifacts


def test_a_store_whose_writer_was_killed_mid_transaction_is_still_the_store(tmp_path):
    """A rank SIGKILLed while it wrote to the SQLite store leaves a hot journal, and a read-only
    open of the file then fails ("attempt to write a readonly database"): the relaunch, or a
    torchrun restart, was refused as "not a SQLite database" (tests/integration/test_torchrun.py's
    restart, once under load). The journal is rolled back, as any client's next open does."""
    import signal
    import sqlite3

    from llama_fsdp.tracking.store import MLFLOW_TABLES, sqlite_store_problem

    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as conn:
        for table in sorted(MLFLOW_TABLES):
            conn.execute(f"CREATE TABLE {table} (x)")
    conn.close()
    pid = os.fork()
    if pid == 0:  # a writer killed with its transaction spilled to the file
        conn = sqlite3.connect(db)
        conn.execute("PRAGMA cache_size=1")
        conn.execute("BEGIN")
        for _ in range(5000):
            conn.execute("INSERT INTO metrics VALUES (?)", ("x" * 200,))
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    assert (tmp_path / "mlflow.db-journal").exists()  # the positive control: a hot journal
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        sqlite3.connect(f"file:{db}?mode=ro", uri=True).execute(
            "SELECT name FROM sqlite_master").fetchall()
    assert sqlite_store_problem(db) is None
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM metrics").fetchone() == (0,)  # rolled back
    conn.close()


@pytest.mark.parametrize("override,message", [
    ("tracking.experiment=''", "tracking.experiment='' is empty"),
    ("tracking.run_name='a\tb'", "tracking.run_name='a\\tb' holds a control character"),
    ("tracking.experiment=" + "x" * 9000, "tracking.experiment is 9000 characters long; MLflow "
                                           "takes at most 500"),
])
def test_names_mlflow_cannot_take_are_refused_before_launch(override, message, tmp_path):
    """Before: tracking.experiment='' trained with no MLflow run, then blamed the store."""
    with pytest.raises(ConfigError) as e:
        make_spec([override], output_dir=tmp_path / "run")
    assert message in str(e.value)


def test_a_run_mlflow_refuses_to_create_fails_at_launch_not_after_training(tmp_path):
    """An experiment of the same name in MLflow's trash: the store refuses the run. Before: the
    run trained without one, and `python -m llama_fsdp.tracking` delivered "0 bytes (run None)"
    forever."""
    from mlflow.tracking import MlflowClient

    from llama_fsdp.prepare.errors import PrepareError
    from llama_fsdp.prepare.job import prepare
    from llama_fsdp.tracking.__main__ import main as deliver

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = make_spec([f"tracking.uri={uri}", "tracking.experiment=gone"],
                     output_dir=tmp_path / "run")
    client = MlflowClient(tracking_uri=uri)
    client.delete_experiment(client.create_experiment("gone"))
    with pytest.raises(PrepareError) as e:
        prepare(spec, command="pytest")
    assert "MLflow refused to create the run in experiment 'gone'" in str(e.value)
    assert "mlflow gc" in str(e.value)
    t0 = time.monotonic()
    assert deliver([str(tmp_path / "run"), "--timeout", "60"]) == 1  # says so, at once
    assert time.monotonic() - t0 < 30


def test_opening_a_store_leaves_nothing_beside_it(tmp_path, monkeypatch):
    """Before: every sqlite store got a .lock file beside it, also from a probe that failed."""
    from llama_fsdp.prepare.tracking import probe_store

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "s").mkdir()
    assert probe_store(f"sqlite:///{tmp_path}/s/mlflow.db") is None
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["mlflow.db"]
    (tmp_path / "f").write_text("a file")
    assert probe_store(f"sqlite:///{tmp_path}/f/mlflow.db") is not None  # fails: below a file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "f", "s"]
