"""benchmarks/reliability.md's table of the finished-run commands (``python -m llama_fsdp.evaluate``
and ``python -m llama_fsdp.generate``) on input someone else wrote or a careless user typed
(issue 63, round three).

Each row calls the command's own ``main`` in this one process, on a tiny run folder made here
(tests/unit/test_finished_run_inputs.py's, whose cases these are): a fresh interpreter a row
would cost some 15 s of imports on 2 cores, and what is measured is the command's own checks.
For each: the exit code (or the exception that escaped ``main``, as a traceback shows it),
whether the message names the problem, seconds, and the bytes of the user's files lost. The
credential row counts the Authorization headers a listener on loopback received.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import sqlite3
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from llama_fsdp.launchers.environment import scoped_environ
from tests.unit import test_finished_run_inputs as cases

HEADER = "## Bad input to evaluate and generate"
TOKEN = cases.TOKEN
MC = cases.MC


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def call(main: Callable[[list[str]], int], argv: list[str], *, stdout: Any = None) -> \
        tuple[Any, str]:
    """``main(argv)``'s exit code, or ``traceback (<exception>)``; and what it logged."""
    collect, root = _Collect(), logging.getLogger()
    root.addHandler(collect)
    level, root.level = root.level, logging.INFO
    try:
        with contextlib.redirect_stdout(stdout or io.StringIO()):
            code: Any = main(argv)
    except SystemExit as e:
        code = e.code
    except Exception as e:  # noqa: BLE001 - what escaped is what the row reports
        code = f"traceback ({type(e).__name__})"
    finally:
        root.removeHandler(collect)
        root.level = level
    return code, "\n".join(collect.lines)


def _user_files(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _lost(before: dict[str, bytes]) -> int:
    return sum(len(v) for k, v in before.items()
               if not Path(k).is_file() or Path(k).read_bytes() != v)


def _env(**values: str) -> Any:
    return scoped_environ(values)


def _evaluate(run: Path, *more: str) -> tuple[Any, str]:
    from llama_fsdp.harness import evaluate_cmd

    return call(evaluate_cmd.main, [str(run), "--tasks", MC, "--limit", "2", "--device", "cpu",
                                    *more])


# --- the rows: (input, before, run(cwd, model) -> (code, log, extra), the text it must show) ---


def credentials(cwd: Path, model: Path) -> tuple[Any, str, str]:
    listener = cases._Listener()
    try:
        run = cases._run(cwd, model, tracking_uri=listener.uri)
        with _env(MLFLOW_TRACKING_TOKEN=TOKEN, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0"):
            code, log = _evaluate(run, "--output", str(cwd / "scores.json"))
        sent = sum(1 for *_, auth in listener.seen if auth)
        return code, log, f"; requests {len(listener.seen)}, with Authorization {sent}"
    finally:
        listener.close()


def remote(cwd: Path, model: Path) -> tuple[Any, str, str]:
    run = cases._run(cwd, model, tracking_uri="https://mlflow.example.com")
    with _env(MLFLOW_TRACKING_TOKEN=TOKEN):
        return (*_evaluate(run), "")


def their_db(cwd: Path, model: Path) -> tuple[Any, str, str]:
    db = cwd / "mine" / "mine.db"  # (made with the user's other files, rows())
    return (*_evaluate(cases._run(cwd, model, tracking_uri=f"sqlite:///{db}")), "")


def output(target: Callable[[Path, Path], Path]) -> Callable[[Path, Path], tuple[Any, str, str]]:
    def go(cwd: Path, model: Path) -> tuple[Any, str, str]:
        run = cases._run(cwd, model)
        return (*_evaluate(run, "--no-mlflow", "--output", str(target(cwd, run))), "")
    return go


def _notes(cwd: Path, run: Path) -> Path:
    return cwd / "mine" / "notes.txt"


def generate(case: str) -> Callable[[Path, Path], tuple[Any, str, str]]:
    def go(cwd: Path, model: Path) -> tuple[Any, str, str]:
        from llama_fsdp.harness import generate_cmd

        make, args, _ = cases.GENERATE_INPUTS[case]
        return (*call(generate_cmd.main, [str(make(cwd, model)), *args, "--device", "cpu"]), "")
    return go


def evaluate(case: str) -> Callable[[Path, Path], tuple[Any, str, str]]:
    def go(cwd: Path, model: Path) -> tuple[Any, str, str]:
        from llama_fsdp.harness import evaluate_cmd

        args, _ = cases.EVALUATE_INPUTS[case]
        if "--include-path" in args:
            at = args.index("--include-path") + 1
            args = [*args[:at], str(cases._task_folder(cwd, args[at])), *args[at + 1:]]
        with _env(HF_DATASETS_OFFLINE="1"):
            return (*call(evaluate_cmd.main, [str(model), *args, "--device", "cpu", "--output",
                                              str(cwd / "scores.json")]), "")
    return go


def stdin_closed(cwd: Path, model: Path) -> tuple[Any, str, str]:
    import sys

    from llama_fsdp.harness import generate_cmd

    stdin, sys.stdin = sys.stdin, None
    try:
        return (*call(generate_cmd.main, [str(model), "--device", "cpu"]), "")
    finally:
        sys.stdin = stdin


def stdin_not_utf8(cwd: Path, model: Path) -> tuple[Any, str, str]:
    import sys

    from llama_fsdp.harness import generate_cmd

    stdin = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(b"Next c\n\xff\xfe bad\n"), encoding="utf-8")
    try:
        return (*call(generate_cmd.main, [str(model), "--device", "cpu", "--max-new-tokens",
                                          "2"]), "")
    finally:
        sys.stdin = stdin


def broken_pipe(cwd: Path, model: Path) -> tuple[Any, str, str]:
    from llama_fsdp.harness import generate_cmd

    read, write = os.pipe()
    os.close(read)
    out = os.fdopen(write, "w")
    try:
        return (*call(generate_cmd.main, [str(model), "a", "b", "--device", "cpu",
                                          "--max-new-tokens", "2"], stdout=out), "")
    finally:
        with contextlib.suppress(OSError):
            out.close()


def sigterm_step(cwd: Path, model: Path) -> tuple[Any, str, str]:
    """SIGTERM to this process once the checkpoint is converted (a handler that only records it
    stands by while the command is not running)."""
    from llama_fsdp.harness import evaluate_cmd

    run = cases._checkpoint_run(cwd, model)
    tmp = cwd / "tmp"
    tmp.mkdir()
    late: list[Any] = []
    previous = signal.signal(signal.SIGTERM, lambda *a: late.append(a))
    before, tempfile.tempdir = tempfile.tempdir, str(tmp)

    def send() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if list(tmp.glob("llama_fsdp-model-*/converted/config.json")):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    threading.Thread(target=send, daemon=True).start()
    try:
        code, log = call(evaluate_cmd.main, [str(run), "--step", "3", "--tasks", MC, "--device",
                                             "cpu", "--no-mlflow"])
    finally:
        tempfile.tempdir = before
        signal.signal(signal.SIGTERM, previous)
    left = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
    return code, log, f"; left in the temporary folder: {left} bytes"


def scenarios() -> list[tuple[str, str, Callable, str]]:
    """(input, what the code before did, run, the text the message must show)."""
    g, e = cases.GENERATE_INPUTS, cases.EVALUATE_INPUTS
    return [
        ("evaluate: run.json names a listener on loopback, MLFLOW_TRACKING_TOKEN set",
         "exit 0; requests 6, with Authorization 6 (`Bearer <token>`)",
         credentials, "no credentials sent"),
        ("evaluate: run.json names `https://mlflow.example.com`",
         "exit 0 after scoring: the token exported for it, every call sent there (out of "
         "reach here: a warning)", remote,
         "which is not the store you configured"),
        ("evaluate: run.json names the user's own SQLite database",
         "exit 0: MLflow's tables added to it (8192 bytes of it changed)", their_db,
         "not an MLflow store"),
        ("evaluate `--output` a file of the user's", "exit 0: replaced by the results JSON "
         "(16 bytes lost)",
         output(_notes), "evaluate never writes over a file"),
        ("evaluate `--output RUN/config.yaml`", "exit 0: the run's config replaced; generate "
         "could no longer read the run", output(lambda c, r: r / "config.yaml"),
         "evaluate never writes over a file"),
        ("evaluate `--output` a folder", "traceback (IsADirectoryError) after the scoring",
         output(lambda c, r: c / "mine"), "is a folder"),
        ("evaluate `--output` where no file can be made (/proc)", "traceback "
         "(FileNotFoundError) after the scoring",
         output(lambda c, r: Path("/proc/llama_fsdp-scores.json")),
         "takes no new file"),
        ("evaluate `--limit inf`", "traceback (OverflowError) after the model was loaded",
         evaluate("limit-inf"), e["limit-inf"][1]),
        ("evaluate `--num-fewshot 100000`", "traceback (ValueError, lm-eval's sampler)",
         evaluate("num-fewshot-100000"), e["num-fewshot-100000"][1]),
        ("evaluate: a task whose local data file is missing", "traceback (FileNotFoundError) "
         "after the model was loaded", evaluate("task-data-missing"), e["task-data-missing"][1]),
        ("evaluate: a task whose data file is malformed JSON lines", "traceback "
         "(DatasetGenerationError) after the model was loaded", evaluate("task-data-malformed"),
         e["task-data-malformed"][1]),
        ("SIGTERM during `evaluate --step` (after the conversion)", "killed by the signal where "
         "it was: the converted model left in the temporary folder (13,674,248 bytes of "
         "13,674,248; the real command, once each for SIGTERM and SIGHUP, by hand)", sigterm_step, "stopped by SIGTERM"),
        *[(f"generate: {label}", before, generate(case), g[case][2]) for case, label, before in (
            ("temperature-nan", "`--temperature nan --sample`", "traceback (ValueError)"),
            ("argv-not-utf8", "a prompt argument that is not UTF-8", "traceback (TypeError)"),
            ("auto-map", "a model folder with auto_map", "traceback (ValueError; no code ran)"),
            ("deep-config-json", "config.json nested 100,000 deep", "traceback "
             "(RecursionError)"),
            ("deep-adapter-config", "adapter_config.json nested 100,000 deep",
             "traceback (RecursionError)"),
            ("adapter-r-0", "`r: 0` in adapter_config.json", "traceback (ZeroDivisionError)"),
            ("adapter-base-missing", "an adapter whose base folder is not there",
             "traceback (OSError)"),
            ("config-yaml-a-list", "a run whose config.yaml is a list",
             "traceback (KeyValidationError)"),
            ("prompt-past-the-context", "a 3,000-token prompt, the model's context 2,048",
             "exit 0: generated past the context without a word"))],
        ("generate: standard input closed", "traceback (AttributeError)", stdin_closed,
         "standard input is closed"),
        ("generate: a standard input line that is not UTF-8", "traceback (UnicodeDecodeError)",
         stdin_not_utf8, "not UTF-8 text"),
        ("generate `a b`, its reader gone (`head -1`)", "traceback (BrokenPipeError)",
         broken_pipe, ""),
    ]


def rows() -> list[dict]:
    from tests.unit.test_finished_run_inputs import _hf_with_tokenizer

    base = Path(tempfile.mkdtemp(prefix="reliability-finished-"))
    model = _hf_with_tokenizer(base / "model")
    out = []
    for n, (name, before, run, shows) in enumerate(scenarios()):
        cwd = base / f"row{n}"
        (cwd / "mine").mkdir(parents=True)
        (cwd / "mine" / "notes.txt").write_text("the user's notes")
        with sqlite3.connect(cwd / "mine" / "mine.db") as conn:
            conn.execute("CREATE TABLE invoices (id INTEGER, total REAL)")
        conn.close()
        user = _user_files(cwd / "mine")
        t0 = time.monotonic()
        code, log, extra = run(cwd, model)
        seconds = time.monotonic() - t0
        out.append({"name": name, "before": before, "code": code, "seconds": seconds,
                    "named": (shows in log) if shows else "- (quiet)", "extra": extra,
                    "traceback": "Traceback" in log,
                    "lost": _lost(user), "log": log})
    import shutil

    shutil.rmtree(base, ignore_errors=True)
    return out


def markdown(rows: list[dict], command: str) -> str:
    lines = ["", HEADER, "",
             f"Each through the command's own `main` in one process (`{command}`; "
             "benchmarks/reliability_finished_run.py says why), on a tiny run folder: what the "
             "code before did (commit 36db986, the same cases as tests/unit/"
             "test_finished_run_inputs.py, whose 28 of 29 tests fail there), and now: the exit "
             "code, whether the message names the problem, and the bytes of the user's files "
             "lost or changed.", "",
             "| input | before | now | time | user data lost |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['before']} | exit {r['code']}, named: {r['named']}"
                     f"{r['extra']} | {r['seconds']:.1f} s | {r['lost']} bytes |")
    lines += ["", f"{len(rows)} inputs tried; exits other than 0, 2, 141 (the reader gone) or "
              f"143 (SIGTERM): {sum(r['code'] not in (0, 2, 141, 143) for r in rows)}; user "
              f"data lost: {sum(r['lost'] for r in rows)} bytes."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    for row in rows():
        print(json.dumps({k: v for k, v in row.items() if k != "log"}))
