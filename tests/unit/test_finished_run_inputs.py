"""``python -m llama_fsdp.evaluate`` and ``python -m llama_fsdp.generate`` on input written by
someone else or typed carelessly (issue 63, round three): a run folder is data, not authority
(its store gets no credentials of the user's, a foreign SQLite file is left as it is), nothing of
the user's is overwritten, every output path and option is checked before the work starts, and
each bad input is one line, never a traceback. In-process through each command's ``main`` on a
tiny run folder made here; the signal test runs the real command."""
from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import sqlite3
import sys
import threading
import time
from pathlib import Path

import pytest

from llama_fsdp.harness import evaluate_cmd, generate_cmd
from tests.conftest import REPO

TOKEN = "tok-of-the-user-never-sent"
MC = "llama_fsdp_synthetic_mc"


def _tokenizer() -> Path:
    from llama_fsdp.data.synthetic import synthetic_corpus
    from llama_fsdp.data.tokenizer import project_tokenizer_dir

    return project_tokenizer_dir(REPO / "outputs" / "cache", synthetic_corpus)


def _hf_with_tokenizer(path: Path) -> Path:
    from tests.unit.test_bad_input import _tiny_hf

    _tiny_hf(path)
    for f in _tokenizer().iterdir():
        if f.is_file():
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The tiny model with the project tokenizer: an HF folder, made once."""
    return _hf_with_tokenizer(tmp_path_factory.mktemp("model") / "hf")


def _run(root: Path, model: Path, *, tracking_uri: str | None = None) -> Path:
    """A run folder as a run leaves it (config.yaml, run.json, export/), naming ``tracking_uri``."""
    run = root / "run"
    shutil.copytree(model, run / "export")
    (run / "config.yaml").write_text("data:\n  name: synthetic\n")
    (run / "tracking").mkdir()
    (run / "tracking" / "run.json").write_text(json.dumps(
        {"tracking_uri": tracking_uri or f"sqlite:///{root / 'none.db'}", "run_id": "r0"}))
    return run


class _Listener:
    """An HTTP server on loopback that answers every request with ``{}`` and keeps each
    request's method, path and Authorization header."""

    def __init__(self) -> None:
        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                seen.append((self.command, self.path, self.headers.get("Authorization")))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST = do_PUT = _any

            def log_message(self, *_: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listener():
    one = _Listener()
    yield one
    one.close()


@pytest.fixture
def credentials(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _evaluate(run: Path, *more: str) -> int:
    return evaluate_cmd.main([str(run), "--tasks", MC, "--limit", "2", "--device", "cpu", *more])


# --- the store a run folder names ---------------------------------------------------------------


def test_a_run_folders_store_gets_none_of_the_users_credentials(tmp_path, model, listener,
                                                                  credentials, caplog):
    """Before: evaluate exported the user's MLFLOW_TRACKING_TOKEN to whatever server run.json
    named, and every call carried `Authorization: Bearer <token>`."""
    from mlflow import MlflowClient

    # the danger is real: MLflow's own client sends the token to any server it is given
    MlflowClient(listener.uri).get_metric_history("r0", "x")
    assert listener.seen and listener.seen[-1][2] == f"Bearer {TOKEN}"
    listener.seen.clear()

    run = _run(tmp_path, model, tracking_uri=listener.uri)
    caplog.set_level("INFO")
    assert _evaluate(run, "--output", str(tmp_path / "scores.json")) == 0
    assert any(m == "POST" and p.endswith("/runs/log-batch") for m, p, _ in listener.seen), \
        listener.seen  # the scores were logged, to a server on this machine
    assert [a for _, _, a in listener.seen] == [None] * len(listener.seen), listener.seen
    assert f"MLflow store: {listener.uri} (named by {run / 'tracking' / 'run.json'}; no " \
           "credentials sent)" in caplog.text


def test_the_store_the_user_names_gets_the_credentials(tmp_path, monkeypatch, credentials):
    from llama_fsdp.harness.store import choose_store

    run = tmp_path / "run"
    (run / "tracking").mkdir(parents=True)
    (run / "tracking" / "run.json").write_text(json.dumps(
        {"tracking_uri": "https://mlflow.example.com", "run_id": "r0"}))
    assert choose_store(run, "https://mlflow.example.com/").credentials  # --tracking-uri
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "HTTPS://mlflow.example.com:443/")
    assert choose_store(run, None).credentials  # the same store, written another way
    assert choose_store(run, None).why == "MLFLOW_TRACKING_URI"


def test_the_users_store_is_read_from_os_environ_as_it_is_now(tmp_path, monkeypatch, credentials):
    """datasets' Dataset.map(num_proc=N) replaces os.environ with a copy (datasets 5.2,
    arrow_dataset.py): a mapping bound before that (a default argument) no longer sees the
    user's MLFLOW_TRACKING_URI, and the user's own store was refused (the suite's CI of
    2026-12-03, after a data test in the same worker)."""
    from llama_fsdp.harness.store import choose_store

    run = tmp_path / "run"
    (run / "tracking").mkdir(parents=True)
    (run / "tracking" / "run.json").write_text(json.dumps(
        {"tracking_uri": "https://mlflow.example.com", "run_id": "r0"}))
    monkeypatch.setattr(os, "environ", os.environ.copy())  # what datasets does
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.com")
    assert choose_store(run, None).why == "MLFLOW_TRACKING_URI"


@pytest.mark.parametrize("named,says", [
    ("https://mlflow.example.com", "names the MLflow store https://mlflow.example.com, which is "
     "not the store you configured (MLFLOW_TRACKING_URI is not set)"),
    ("http://user:pw@10.1.2.3:5000", "names the MLflow store http://10.1.2.3:5000, which is not "
     "the store you configured"),
    ("databricks://profile", "names the MLflow store databricks://profile"),
], ids=["remote", "credentials-in-the-folder", "other-scheme"])
def test_a_store_elsewhere_named_by_a_folder_is_refused_before_scoring(tmp_path, model, named,
                                                                       says, credentials,
                                                                       caplog):
    run = _run(tmp_path, model, tracking_uri=named)
    t0 = time.monotonic()
    assert _evaluate(run) == 2
    assert says in caplog.text and "--tracking-uri" in caplog.text and "--no-mlflow" in \
        caplog.text
    assert "pw" not in caplog.text
    assert not (run / "harness").exists()  # nothing scored
    assert time.monotonic() - t0 < 10


def test_a_users_sqlite_database_named_by_a_folder_is_left_byte_for_byte(tmp_path, model,
                                                                           caplog):
    """Before: evaluate added MLflow's tables to the user's database and exited 0."""
    db = tmp_path / "mine.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER, total REAL)")
    conn.close()
    before = db.read_bytes()
    run = _run(tmp_path, model, tracking_uri=f"sqlite:///{db}")
    assert _evaluate(run) == 2
    assert f"{db}, a SQLite database that is not an MLflow store (its tables: invoices)" in \
        caplog.text
    assert db.read_bytes() == before and not (tmp_path / "mlartifacts").exists()
    assert not (run / "harness").exists()
    # a store file that is not there is not made either
    (run / "tracking" / "run.json").write_text(json.dumps(
        {"tracking_uri": f"sqlite:///{tmp_path / 'gone.db'}", "run_id": "r0"}))
    assert _evaluate(run) == 2
    assert "which does not exist here: evaluate never creates a store" in caplog.text
    assert not (tmp_path / "gone.db").exists()


def test_the_runs_own_sqlite_store_gets_the_scores_and_the_results(tmp_path, model, caplog):
    """The usual case stays as it was: a run's store on this machine (the default SQLite file)
    gets the scores at the step of the weights and the results JSON as an artifact."""
    from llama_fsdp.tracking.store import open_client

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = open_client(uri)
    run_id = client.create_run(client.create_experiment(
        "e", artifact_location=(tmp_path / "mlartifacts").as_uri())).info.run_id
    run = _run(tmp_path, model, tracking_uri=uri)
    (run / "tracking" / "run.json").write_text(json.dumps({"tracking_uri": uri,
                                                           "run_id": run_id}))
    caplog.set_level("INFO")
    assert _evaluate(run) == 0
    acc = client.get_metric_history(run_id, f"harness/{MC}/acc")
    assert [m.step for m in acc] == [0]
    results = run / "harness" / "step_000000" / "results.json"
    logged = Path(client.download_artifacts(run_id, "harness/step_000000/results.json",
                                            str(tmp_path / "dl")))
    assert logged.read_text() == results.read_text()
    assert f"MLflow store: {uri} (named by {run / 'tracking' / 'run.json'}; no credentials " \
           "sent)" in caplog.text


# --- where the results go -----------------------------------------------------------------------


def _notes(tmp_path: Path) -> Path:
    notes = tmp_path / "notes.txt"
    notes.write_text("the user's notes")
    return notes


@pytest.mark.parametrize("output,says", [
    (lambda t: _notes(t), "exists: evaluate never writes over a file"),
    (lambda t: t, "is a folder: give a file name"),
    (lambda t: _notes(t) / "scores.json", "is a file, not a folder"),
    (lambda t: Path("/proc/llama_fsdp-scores.json"), "takes no new file"),
], ids=["a-file-of-the-users", "a-folder", "below-a-file", "unwritable"])
def test_an_output_that_cannot_be_written_is_refused_before_scoring(tmp_path, model, output,
                                                                    says, caplog):
    """Before: --output replaced any file (a user's notes, the run's config.yaml); a folder or
    an unwritable place failed with a traceback after the whole evaluation."""
    run = _run(tmp_path, model)
    notes = _notes(tmp_path)
    out = output(tmp_path)
    assert _evaluate(run, "--no-mlflow", "--output", str(out)) == 2
    assert says in caplog.text, caplog.text
    assert notes.read_text() == "the user's notes"
    assert not (run / "harness").exists()


def test_the_runs_own_config_is_never_replaced(tmp_path, model):
    run = _run(tmp_path, model)
    before = (run / "config.yaml").read_bytes()
    assert _evaluate(run, "--no-mlflow", "--output", str(run / "config.yaml")) == 2
    assert (run / "config.yaml").read_bytes() == before


# --- one line, never a traceback ----------------------------------------------------------------


def _deep(path: Path, depth: int = 100_000) -> None:
    path.write_text('{"r": ' + "[" * depth + "]" * depth + "}")


def _adapter(tmp_path: Path, model: Path, **cfg) -> Path:
    ad = tmp_path / "adapter"
    ad.mkdir()
    (ad / "adapter_config.json").write_text(json.dumps(
        {"base_model_name_or_path": str(model), "r": 4, "lora_alpha": 8, **cfg}))
    from safetensors.torch import save_file
    import torch

    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 8),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
                   torch.zeros(8, 4)}, str(ad / "adapter_model.safetensors"))
    return ad


def _auto_map(tmp_path: Path, model: Path) -> Path:
    hf = tmp_path / "theirs"
    shutil.copytree(model, hf)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "model_type": "evil", "auto_map": {
        "AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.Evil"}}))
    return hf


def _deep_config(tmp_path: Path, model: Path) -> Path:
    hf = tmp_path / "deep"
    shutil.copytree(model, hf)
    _deep(hf / "config.json")
    return hf


def _deep_adapter(tmp_path: Path, model: Path) -> Path:
    ad = _adapter(tmp_path, model)
    _deep(ad / "adapter_config.json")
    return ad


def _yaml_list(tmp_path: Path, model: Path) -> Path:
    run = _run(tmp_path, model)
    (run / "config.yaml").write_text("- just\n- a list\n")
    return run


# (the model folder made from tmp_path and the tiny model, the arguments after it, the message)
GENERATE_INPUTS = {
    "temperature-nan": (lambda t, m: m, ["hi", "--sample", "--temperature", "nan"],
                        "--temperature nan must be a finite number > 0"),
    "argv-not-utf8": (lambda t, m: m, [b"caf\xe9".decode("utf-8", "surrogateescape")],
                      "prompt 1 is not UTF-8 text (character 4)"),
    "auto-map": (_auto_map, ["hi"], "config.json names Python classes of its own (auto_map"),
    "deep-config-json": (_deep_config, ["hi"], "nests JSON deeper than any config does"),
    "deep-adapter-config": (_deep_adapter, ["hi"], "adapter_config.json nests JSON deeper"),
    "adapter-r-0": (lambda t, m: _adapter(t, m, r=0), ["hi"], "r is 0, not a rank >= 1"),
    "adapter-base-missing": (lambda t, m: _adapter(t, m, base_model_name_or_path=str(
        t / "moved")), ["hi"], "names the base model"),
    "config-yaml-a-list": (_yaml_list, ["hi"], "config.yaml is not a run's config (a YAML "
                           "ListConfig, not a mapping)"),
    "prompt-past-the-context": (lambda t, m: m, ["x " * 3000], "more than the model's "
                                "context of 2,048 (max_position_embeddings in config.json)"),
}


@pytest.mark.parametrize("case", list(GENERATE_INPUTS))
def test_generate_names_bad_input_in_one_line(case, tmp_path, model, caplog, capsys):
    """Before: each of these was a traceback (or, for the long prompt, minutes of generating
    with no word; for nan, a sampler's error)."""
    make, args, says = GENERATE_INPUTS[case]
    folder = make(tmp_path, model)
    assert generate_cmd.main([str(folder), *args, "--device", "cpu"]) == 2
    assert says in caplog.text, caplog.text
    assert capsys.readouterr().out == ""  # no answer


def test_a_closed_stdin_is_named(tmp_path, model, monkeypatch, caplog):
    monkeypatch.setattr(sys, "stdin", None)
    assert generate_cmd.main([str(model), "--device", "cpu"]) == 2
    assert "standard input is closed" in caplog.text


def test_a_stdin_line_that_is_not_utf8_is_skipped_with_its_number(model, monkeypatch, caplog,
                                                                  capsys):
    import io

    stdin = io.TextIOWrapper(io.BytesIO(b"Next c\n\xff\xfe bad\nNext d\n"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    assert generate_cmd.main([str(model), "--device", "cpu", "--max-new-tokens", "2"]) == 2
    assert "standard input, line 2: not UTF-8 text (byte 1): skipped" in caplog.text
    assert len(capsys.readouterr().out.splitlines()) == 2  # lines 1 and 3 answered


def test_ctrl_c_in_a_chat_is_one_line(model, monkeypatch, caplog):
    """Before: a KeyboardInterrupt traceback."""
    class Interrupted:
        def isatty(self) -> bool:
            return False

        class buffer:  # noqa: N801 - as sys.stdin.buffer
            @staticmethod
            def readline() -> bytes:
                raise KeyboardInterrupt

        readline = buffer.readline

    monkeypatch.setattr(sys, "stdin", Interrupted())
    try:
        code = generate_cmd.main([str(model), "--device", "cpu"])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped generate's main: a traceback")
    assert code == 130
    assert "stopped by Ctrl-C" in caplog.text


def test_a_reader_that_goes_away_ends_generate_quietly(model, monkeypatch):
    """`generate RUN a b | head -1`: before, a BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)
    out = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stdout", out)
    try:
        code = generate_cmd.main([str(model), "a", "b", "--device", "cpu", "--max-new-tokens",
                                  "2"])
    finally:
        monkeypatch.undo()
        try:
            out.close()
        except OSError:
            pass
    assert code == 128 + signal.SIGPIPE


def _task_folder(tmp_path: Path, data: str | None) -> Path:
    folder = tmp_path / "tasks"
    folder.mkdir()
    docs = tmp_path / "docs.jsonl"
    if data is not None:
        docs.write_text(data)
    (folder / "mine.yaml").write_text(
        "task: my_local_task\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {docs}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{q}}'\n"
        "doc_to_target: '{{a}}'\nmetric_list:\n  - metric: exact_match\n")
    return folder


EVALUATE_INPUTS = {
    "limit-inf": (["--tasks", MC, "--limit", "inf"], "--limit inf must be a finite number > 0"),
    "num-fewshot-100000": (["--tasks", MC, "--num-fewshot", "100000"],
                           "--num-fewshot 100000: that many examples cannot fit the model's "
                           "context of 2048 tokens"),
    "task-data-missing": (["--tasks", "my_local_task", "--include-path", None],
                          "my_local_task reads "),
    "task-data-malformed": (["--tasks", "my_local_task", "--include-path", '{"q": "a", "a": '],
                            "line 1: malformed JSON"),
}


@pytest.mark.parametrize("case", list(EVALUATE_INPUTS))
def test_evaluate_names_bad_input_in_one_line(case, tmp_path, model, caplog, monkeypatch):
    """Before: OverflowError (inf), ValueError from lm-eval's sampler, FileNotFoundError or a
    datasets error, each a traceback after the model was loaded."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    args, says = EVALUATE_INPUTS[case]
    if "--include-path" in args:
        at = args.index("--include-path") + 1
        args = [*args[:at], str(_task_folder(tmp_path, args[at])), *args[at + 1:]]
    assert evaluate_cmd.main([str(model), *args, "--device", "cpu", "--output",
                              str(tmp_path / "scores.json")]) == 2
    assert says in caplog.text, caplog.text
    assert not (tmp_path / "scores.json").exists()


def test_evaluate_runs_a_task_folders_python_only_with_trust_task_code(tmp_path, model, caplog,
                                                                       monkeypatch):
    """(issue 63 item 4: `!function utils.x` in an --include-path YAML imported the folder's
    Python without a word.) Refused before the model is read, naming the file and the flag that
    consents; with --trust-task-code the check passes it on to lm-eval."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = _task_folder(tmp_path, '{"q": "1+1=", "a": "2"}\n')
    (folder / "mine.yaml").write_text((folder / "mine.yaml").read_text().replace(
        "doc_to_text: '{{q}}'", "doc_to_text: !function utils.prompt"))
    (folder / "utils.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n\n"
                                     "def prompt(doc):\n    return doc['q']\n")
    args = [str(model), "--tasks", "my_local_task", "--include-path", str(folder), "--device",
            "cpu", "--output", str(tmp_path / "scores.json"), "--no-mlflow"]
    assert evaluate_cmd.main(args) == 2
    assert f"name Python with !function, which lm-eval would import and run: " \
           f"{folder / 'utils.py'}" in caplog.text, caplog.text
    assert "consent with --trust-task-code" in caplog.text
    assert not (tmp_path / "ran").exists() and not (tmp_path / "scores.json").exists()
    caplog.clear()
    with caplog.at_level("WARNING"):
        from llama_fsdp import harness
        from llama_fsdp.config.schema import HarnessConfig

        assert harness.harness_problems(HarnessConfig(
            tasks=["my_local_task"], include_path=str(folder), trust_task_code=True),
            include_key="--include-path", consent="--trust-task-code") == []
    assert f"lm-eval will run the task folder's Python: {folder / 'utils.py'}" in caplog.text
    assert "--trust-task-code" in evaluate_cmd._parser().format_help()


# --- a signal while a checkpoint is converted ---------------------------------------------------


def _checkpoint_run(root: Path, model: Path) -> Path:
    """A run folder with one DCP checkpoint (step 3) of the tiny model, its tokenizer beside."""
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaForCausalLM

    from llama_fsdp.checkpoint import hf
    from llama_fsdp.config.rundir import HF_META

    run = _run(root, model)
    ckpt = run / "checkpoints" / "step_000003"
    m = LlamaForCausalLM.from_pretrained(model)
    dcp.save({"app": {"model": m.state_dict(), "train": {"step": 3}}}, checkpoint_id=str(ckpt),
             no_dist=True)
    hf.write_hf_meta(ckpt / HF_META, m.config)
    for f in _tokenizer().iterdir():
        if f.is_file():
            shutil.copy(f, ckpt / HF_META / f.name)
    return run


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["TERM", "HUP"])
def test_a_signal_during_evaluate_step_removes_the_converted_model(sig, tmp_path, model,
                                                                    monkeypatch, caplog):
    """Before: SIGTERM or SIGHUP ended the process where it was, and the converted model (the
    model's size, for a real one) stayed in the temporary folder. The signal is this process's
    own, sent once the converted model is there (a handler that only records it stands in
    for pytest's while the command is not running)."""
    import tempfile

    run = _checkpoint_run(tmp_path, model)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    late = []
    previous = signal.signal(sig, lambda *a: late.append(a))
    sent = threading.Event()

    def send_once_converted() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if list(tmp.glob("llama_fsdp-model-*/converted/config.json")):
                os.kill(os.getpid(), sig)
                sent.set()
                return
            time.sleep(0.01)

    threading.Thread(target=send_once_converted, daemon=True).start()
    try:
        code = evaluate_cmd.main([str(run), "--step", "3", "--tasks", MC, "--device", "cpu",
                                  "--no-mlflow"])
    finally:
        signal.signal(sig, previous)
    assert sent.is_set() and not late
    assert code == 128 + sig
    assert f"stopped by {sig.name}" in caplog.text
    assert list(tmp.iterdir()) == [], [(p, p.stat().st_size) for p in tmp.rglob("*")]
    assert not (run / "harness").exists()
