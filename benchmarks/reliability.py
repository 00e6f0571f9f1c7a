"""Each fault of the fault suite, timed: what happens, how long until the run stops or
recovers, what is lost; and each bad input, refused before launch with nothing of the user's
lost. Writes benchmarks/reliability.md.

    .venv/bin/python benchmarks/reliability.py --out benchmarks/reliability.md
    .venv/bin/python benchmarks/reliability.py --only-bad-inputs   # that table alone
    .venv/bin/python benchmarks/reliability.py --only-finished-run-inputs   # evaluate, generate
    .venv/bin/python benchmarks/reliability.py --only-training-inputs   # issue 63's training side

Every scenario drives the real command (`python -m llama_fsdp`, 2 CPU ranks, the tiny model)
in a fresh directory, with the faults of tests/faults/hooks.py, a real `mlflow server` on
loopback, and real signals. Times are wall seconds on this machine (2 cores).
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))

from benchmarks import reliability_finished_run as finished_run  # noqa: E402
from benchmarks import reliability_training as training  # noqa: E402
from llama_fsdp.config.rundir import RunDir  # noqa: E402
from tests.faults import hooks  # noqa: E402
from tests.faults.conftest import (  # noqa: E402
    MlflowServer,
    leftovers,
    logged_steps,
    no_leftovers,
    run_cli,
    run_dir,
    start_cli,
    wait_for_step,
)


def _tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="reliability-"))


def _spool_times(run: Path) -> dict[int, float]:
    """Step -> wall time (ms) its metrics were recorded, from rank 0's spool."""
    from llama_fsdp.tracking import Spool, events

    out = {}
    for e in Spool(run).events():
        if isinstance(e, events.Metrics) and "loss" in e.metrics:
            out.setdefault(e.step, e.ts)
    return out


def killed_rank(restarts: int) -> dict:
    cwd = _tmp()
    proc = start_cli(cwd, "train.max_steps=40", "save.every_steps=5",
                     f"cluster.max_restarts={restarts}",
                     "train.callbacks=[tests.faults.hooks:self_signal,tests.faults.hooks:slow]",
                     env={hooks.SIGNAL: "rank=1,step=12,sig=KILL", hooks.SLOW: "0.1",
                          hooks.MARK: str(cwd / "fired")})
    t0 = None
    out = ""
    while proc.poll() is None:
        line = proc.stdout.readline()
        out += line
        if t0 is None and "the first rank to fail" in line:
            t0 = time.monotonic()
    out += proc.stdout.read()
    end = time.monotonic()
    run = run_dir(cwd)
    times = _spool_times(run)
    named = "rank 1 on" in out.split("the first rank to fail:")[1][:100] and "SIGKILL" in out
    row = {"code": proc.returncode, "named": named}
    if restarts:
        # from the last step before the kill to the first step after the restart
        resumed = sorted(s for s in times if s > 12)
        row["recover_s"] = (times[resumed[0]] - times[12]) / 1000 if resumed else None
        row["lost_steps"] = 12 - 10  # trained after the last checkpoint (step 10)
    else:
        row["stop_s"] = end - t0 if t0 else None
    return row


def signal_launcher(sig: signal.Signals, twice: bool = False) -> dict:
    cwd = _tmp()
    proc = start_cli(cwd, "train.max_steps=400", "save.every_steps=1000",
                     "train.callbacks=[tests.faults.hooks:slow]", env={hooks.SLOW: "0.2"})
    wait_for_step(cwd, 3, proc)
    t0 = time.monotonic()
    proc.send_signal(sig)
    if twice:
        time.sleep(0.3)
        proc.send_signal(sig)
    proc.communicate(timeout=120)
    exited = time.monotonic() - t0
    left = no_leftovers(str(cwd), within_s=30)
    gone = time.monotonic() - t0
    ckpts = sorted(p.name for p in RunDir(run_dir(cwd)).checkpoints.glob("step_*"))
    return {"code": proc.returncode, "exit_s": exited, "all_gone_s": gone, "left": left,
            "checkpoints": ckpts}


def _processes(cwd: Path) -> int:
    return len(leftovers(str(cwd)))


def launcher_sigkill() -> dict:
    """SIGKILL to the launcher: how long until no process of the run is left; the newest
    checkpoint intact."""
    from llama_fsdp.checkpoint.layout import latest_checkpoint, verify

    cwd = _tmp()
    proc = start_cli(cwd, "train.max_steps=400", "save.every_steps=2",
                     "train.callbacks=[tests.faults.hooks:slow]", env={hooks.SLOW: "0.2"})
    run = wait_for_step(cwd, 5, proc)
    before = _processes(cwd)
    t0 = time.monotonic()
    proc.kill()
    proc.wait(timeout=60)
    left = no_leftovers(str(cwd), within_s=60)
    newest = latest_checkpoint(run)
    return {"before": before, "all_gone_s": time.monotonic() - t0, "left": left,
            "intact": newest is not None and verify(newest) is None,
            "newest": newest.name if newest else None}


def supervisor_sigkill() -> dict:
    """SIGKILL to rank 1's supervisor with cluster.max_restarts=1: named, restarted, finished."""
    import psutil

    cwd = _tmp()
    proc = start_cli(cwd, "train.max_steps=20", "save.every_steps=5", "cluster.max_restarts=1",
                     "train.callbacks=[tests.faults.hooks:slow]", env={hooks.SLOW: "0.2"})
    run = wait_for_step(cwd, 12, proc)
    victim = next(p for p in psutil.process_iter(["cmdline"])
                  if "submitit.core._submit" in " ".join(p.info["cmdline"] or [])
                  and str(cwd) in " ".join(p.info["cmdline"] or [])
                  and p.environ().get("SUBMITIT_LOCAL_GLOBALID") == "1")
    victim.kill()
    t_kill = time.time() * 1000
    out, _ = proc.communicate(timeout=600)
    times = _spool_times(run)
    resumed = sorted(s for s, t in times.items() if t > t_kill and s > 10)
    return {"code": proc.returncode, "named": "rank 1's supervisor on" in out,
            "recover_s": (times[resumed[0]] - t_kill) / 1000 if resumed else None,
            "left": no_leftovers(str(cwd), within_s=30)}


def second_launch() -> dict:
    """A second launch into a live run's directory: refused, in how long."""
    cwd = _tmp()
    proc = start_cli(cwd, "train.max_steps=400", "train.callbacks=[tests.faults.hooks:slow]",
                     env={hooks.SLOW: "0.2"})
    run = wait_for_step(cwd, 2, proc)
    code, out, seconds = run_cli(cwd, f"output_dir={run}")
    proc.kill()
    no_leftovers(str(cwd), within_s=60)
    return {"code": code, "seconds": seconds, "named": f"pid {proc.pid} on" in out}


def damaged_cache() -> dict:
    """A truncated tokenized split in the cache: named and rebuilt."""
    cwd = _tmp()
    run_cli(cwd, "train.max_steps=2", "tracking.enabled=false")
    arrow = next((cwd / "outputs" / "cache" / "data").glob("synthetic-*/train/*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    code, out, seconds = run_cli(cwd, "train.max_steps=2", "tracking.enabled=false")
    return {"code": code, "seconds": seconds, "rebuilt": "is damaged" in out and str(arrow) in out}


def server_outage() -> dict:
    cwd = _tmp()
    server = MlflowServer(cwd).start()
    proc = start_cli(cwd, f"tracking.uri={server.uri}", "train.max_steps=60")
    run = wait_for_step(cwd, 10, proc)
    server.kill()
    t_kill = time.time() * 1000
    out, _ = proc.communicate(timeout=600)
    times = _spool_times(run)
    before = [times[s] - times[s - 1] for s in times if s - 1 in times and times[s] < t_kill]
    after = [times[s] - times[s - 1] for s in times if s - 1 in times and times[s - 1] > t_kill]
    server.start()
    import subprocess

    replay = subprocess.run([sys.executable, "-m", "llama_fsdp.tracking", str(run)],
                            capture_output=True, text=True, timeout=300)
    from mlflow.tracking import MlflowClient

    from llama_fsdp.tracking import read_run_file

    steps = {m.step for m in MlflowClient(server.uri).get_metric_history(
        read_run_file(run)["run_id"], "loss")}
    server.kill()
    return {"code": proc.returncode, "finished": max(logged_steps(run)),
            "step_ms_before": statistics.median(before), "step_ms_during": statistics.median(after),
            "replay_code": replay.returncode, "lost": 60 - len(steps)}


def unreachable() -> dict:
    from llama_fsdp.launchers.environment import free_port

    code, _, seconds = run_cli(_tmp(), f"tracking.uri=http://127.0.0.1:{free_port()}")
    return {"code": code, "seconds": seconds}


def disk_full() -> dict:
    cwd = _tmp()
    code, out, seconds = run_cli(cwd, "train.max_steps=6", "save.every_steps=2",
                                 "train.callbacks=[tests.faults.hooks:disk_full_at_save]",
                                 env={hooks.DISK_FULL_STEP: "4"})
    kept = sorted(p.name for p in (run_dir(cwd) / "checkpoints").iterdir())
    return {"code": code, "seconds": seconds, "kept": kept,
            "clear": "No space left on device" in out and "is intact" in out}


def corrupt_newest() -> dict:
    cwd = _tmp()
    run_cli(cwd, "train.max_steps=6", "save.every_steps=2", "save.keep_last=3")
    run = run_dir(cwd)
    data = sorted((run / "checkpoints" / "step_000006").glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    code, out, seconds = run_cli(cwd, "train.max_steps=8", "save.every_steps=2",
                                 f"output_dir={run}")
    return {"code": code, "seconds": seconds, "fell_back": "step_000004 at step 4" in out}


# --- bad input: each tried with the real command, refused before launch, nothing lost ---------


def _user_files(root: Path) -> dict[str, bytes]:
    """The user's things under ``root``: every file's bytes and every directory."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in [root, *root.rglob("*")]} if root.exists() else {}


def _lost(before: dict[str, bytes], root: Path) -> int:
    """Bytes (and directories, 1 each) of ``before`` that are gone or changed under ``root``."""
    after = _user_files(root)
    return sum(max(len(v), 1) for k, v in before.items() if after.get(k) != v)


def _crafted(cwd: Path, marker: Path) -> Path:
    from tests.unit.test_checkpoint import crafted_checkpoint

    return crafted_checkpoint(cwd / "theirs" / "checkpoints" / "step_000004", marker)


def _tiny_model(path: Path) -> Path:
    from tests.unit.test_bad_input import _tiny_hf

    return _tiny_hf(path)


def _scenarios() -> list[tuple]:
    """(row, what today's main did, setup(cwd, mine) -> overrides or argv, the text the refusal
    must show, a check(cwd, mine) -> bool of what must not have happened)."""
    def folder(cwd, mine):
        (mine / "export").mkdir(parents=True)
        (mine / "export" / "weights.bin").write_bytes(b"\x00" * 1000)
        (mine / "config.yaml").write_text("mine: true\n")
        return [f"output_dir={mine}", "save.export_hf=true"]

    def empty(cwd, mine):
        mine.mkdir()
        return [f"output_dir={mine}", "train.lr=-1"]

    def dry(cwd, mine):
        mine.mkdir()
        return [f"output_dir={mine}", "dry_run=true"]

    def export(cwd, mine):
        (mine / "export").mkdir(parents=True)
        (mine / "owner.lock").touch()
        (mine / "export" / "notes.txt").write_text("mine")
        return [f"output_dir={mine}", "save.export_hf=true"]

    def password(cwd, mine):
        from llama_fsdp.launchers.environment import free_port

        return [f"tracking.uri=http://alice:{SECRET}@127.0.0.1:{free_port()}",
                "tracking.enabled=true"]

    def line_break(cwd, mine):
        return ["cluster=slurm", "dry_run=true", "cluster.partition='gpu\ntouch /tmp/x'"]

    def crafted_resume(cwd, mine):
        return [f"resume={_crafted(cwd, cwd / 'marker')}"]

    def crafted_convert(cwd, mine):
        return ["-m", "llama_fsdp.checkpoint.convert", str(_crafted(cwd, cwd / "marker")), str(cwd / "hf")]

    def truncated(cwd, mine):
        hf = _tiny_model(mine / "model")
        shard = sorted(hf.glob("*.safetensors"))[0]
        shard.write_bytes(shard.read_bytes()[:-4096])
        return [f"model.path={hf}"]

    def bad_json(cwd, mine):
        hf = _tiny_model(mine / "model")
        (hf / "config.json").write_text('{"hidden_size": 256,')
        return [f"model.path={hf}"]

    def numbers(cwd, mine):
        return ["train.lr=nan", "train.max_grad_norm=nan", "train.beta1=1.5", "train.eps=0",
                "train.weight_decay=-1", "model.init_std=nan", "cluster.mem_gb=-8",
                "cluster.timeout_min=-5", "train.max_steps=-5"]

    def callback(cwd, mine):
        return ["train.callbacks=[no_such_module:hook]"]

    def gzipped(cwd, mine):
        import gzip

        mine.mkdir()
        (mine / "train.jsonl").write_bytes(gzip.compress(b'{"text": "hi"}\n' * 100))
        return ["data=jsonl", f"data.path={mine / 'train.jsonl'}"]

    def run_id(cwd, mine):
        return ["cluster=torchrun", "dry_run=true"]

    # issue "nothing lost, nothing run, round two"
    def earlier_run(cwd, mine):
        for step in (2, 4):  # an earlier run's checkpoints (complete: .metadata)
            ckpt = mine / "checkpoints" / f"step_{step:06d}"
            ckpt.mkdir(parents=True)
            (ckpt / ".metadata").write_bytes(b"\x00" * 64)
            (ckpt / "__0_0.distcp").write_bytes(b"\x01" * 4096)
        (mine / "owner.lock").touch()
        return [f"output_dir={mine}", "resume=none", "save.every_steps=1", "save.keep_last=1",
                "train.stop_after=1"]

    def remote_code(cwd, mine):
        from tests.unit.test_hostile_inputs import _project_tokenizer, _with_remote_code

        mine.mkdir()
        tok = _with_remote_code(_project_tokenizer(mine), cwd / "marker")
        return [f"data.tokenizer={tok}"]

    def deep_json(cwd, mine):
        mine.mkdir()
        n = 100_000
        (mine / "deep.jsonl").write_text('{"instruction": "x", "input": ' + "[" * n + "]" * n
                                         + ', "output": "y"}\n')
        return ["data=jsonl", f"data.path={mine / 'deep.jsonl'}"]

    def endless_template(cwd, mine):
        import json

        mine.mkdir()
        (mine / "chat.jsonl").write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]})
            + "\n" for i in range(20)))
        (mine / "endless.jinja").write_text(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
            "{% for m in messages %}{{ m['content'] }}{% endfor %}")
        return ["data=jsonl", f"data.path={mine / 'chat.jsonl'}", "data.format=chat",
                f"data.chat_template={mine / 'endless.jinja'}"]

    def lying_header(cwd, mine):
        import json

        hf = _tiny_model(mine / "model")
        shard = sorted(hf.glob("*.safetensors"))[0]
        blob = shard.read_bytes()
        n = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8:8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["dtype"] = "F64" if header[name]["dtype"] != "F64" else "F32"
        head = json.dumps(header, separators=(",", ":")).encode().ljust(n)
        assert len(head) == n
        shard.write_bytes(blob[:8] + head + blob[8 + n:])
        return [f"model.path={hf}"]

    def string_shape(cwd, mine):
        import json

        hf = _tiny_model(mine / "model")
        cfg = json.loads((hf / "config.json").read_text())
        (hf / "config.json").write_text(json.dumps({**cfg, "hidden_size": "256"}))
        return [f"model.path={hf}"]

    def their_db(cwd, mine):
        import sqlite3

        mine.mkdir()
        with sqlite3.connect(mine / "mine.db") as conn:
            conn.execute("CREATE TABLE invoices (id INTEGER, total REAL)")
        conn.close()
        return [f"tracking.uri=sqlite:///{mine / 'mine.db'}", "tracking.enabled=true"]

    def empty_experiment(cwd, mine):
        return ["tracking.experiment=''", "tracking.enabled=true"]

    def bounds(cwd, mine):
        return ["train.seed=-1", "cluster.init_timeout_s=100000000000000000000",
                "train.grad_accum=4611686018427387904", "data.num_proc=1000000"]

    def layers(cwd, mine):
        return ["model.num_layers=1000000000", "dry_run=true"]

    def below_a_file(cwd, mine):
        mine.mkdir()
        (mine / "notes.txt").write_text("mine")
        return [f"output_dir={mine / 'notes.txt' / 'run'}"]

    return [
        ("`output_dir=` at a folder of the user's (config.yaml, export/weights.bin)",
         "trained there: config.yaml overwritten, run_status.json written, export/ deleted with "
         "the user's file", folder, "is not empty and is not a llama_fsdp run directory", None),
        ("a refused run whose `output_dir=` is an empty folder the user made",
         "the folder removed", empty, "train.lr=-1.0 must be > 0", None),
        ("`dry_run=true output_dir=<folder>`", "left an empty outputs/runs/<date>/<time>", dry,
         "nothing launched", lambda cwd, mine: not (cwd / "outputs").exists()),
        ("a run dir whose export/ holds a file of the user's, `save.export_hf=true`",
         "export/ deleted (shutil.rmtree) at the end of training", export,
         "export would replace what is there", None),
        ("the tracking password in `tracking.uri` (store down)",
         "the password in the refusal and, with a live store, in config.yaml, run.json, the "
         "spool, owner.json, the submitit pickle and MLflow", password, "does not answer",
         lambda cwd, mine: not any(SECRET.encode() in p.read_bytes()
                                   for p in cwd.rglob("*") if p.is_file())),
        ("a line break in `cluster.partition`",
         "a shell line of its own in the job script, which ran", line_break,
         "holds a line break", None),
        ("`resume=` a checkpoint with a crafted .metadata",
         "unpickled on every rank: the payload ran", crafted_resume,
         "would load posix.system", lambda cwd, mine: not (cwd / "marker").exists()),
        ("`convert` of that checkpoint", "the payload ran", crafted_convert,
         "would load posix.system", lambda cwd, mine: not (cwd / "marker").exists()),
        ("`model.path` with a truncated safetensors shard",
         "passed every check; the ranks failed in DCP's reader (60 lines, no file named)",
         truncated, "truncated", None),
        ("`model.path` whose config.json is not JSON", "a raw JSONDecodeError", bad_json,
         "is not valid JSON", None),
        ("nine numbers out of range (lr=nan, max_grad_norm=nan, beta1=1.5, eps=0, "
         "weight_decay=-1, init_std=nan, mem_gb=-8, timeout_min=-5, max_steps=-5)",
         "8 of 9 accepted at compose (NaN trained silently; the rest failed in the ranks or "
         "made a bogus plan); max_steps=-5 "
         "suggested warmup_steps=-1", numbers, "train.lr=nan must be a finite number > 0",
         None),
        ("`train.callbacks=[no_such_module:hook]`", "imported only on the ranks, after the "
         "model was built", callback, "cannot be imported", None),
        ("a gzip'd `.jsonl`", "`line 1: malformed JSON`", gzipped, "not a text file", None),
        ("a torchrun run id `../../x`", "the run dir outside outputs/runs", run_id,
         "becomes a folder name", None),
        ("`resume=none` into an earlier run's folder (its step_2 and step_4), `save.keep_last=1`",
         "deleted its step_2, pruned its own step_1 against their numbers, left step_4 for a "
         "later resume=auto", earlier_run, "holds the checkpoints of an earlier run", None),
        ("`data.tokenizer=` a folder whose tokenizer_config.json has auto_map and a .py file",
         "transformers asked on the terminal; answering y ran the file in the launcher",
         remote_code, "names Python classes of its own",
         lambda cwd, mine: not (cwd / "marker").exists()),
        ("a `.jsonl` record nested 100,000 levels deep", "the launcher segfaulted (exit 139), "
         "no message, owner files left", deep_json, "JSON nested more than 100 levels", None),
        ("a chat template of two nested 100,000-step loops", "data preparation hung at 100% CPU",
         endless_template, "the chat template ran for more than 10 s", None),
        ("`model.path` whose safetensors header lies about a tensor's dtype",
         "passed the pre-launch check", lying_header, "does not describe its data", None),
        ("`model.path` whose config.json has `\"hidden_size\": \"256\"`",
         "\"256 but config.json has 256\", suggesting model.hidden_size=256", string_shape,
         "hidden_size is a str ('256'), not a whole number", None),
        ("`tracking.uri=sqlite:///` the user's own SQLite database",
         "about 60 MLflow tables added to it, an mlartifacts/ folder beside it", their_db,
         "not an MLflow store", None),
        ("`tracking.experiment=''`", "trained with no MLflow run, then blamed the store",
         empty_experiment, "tracking.experiment='' is empty", None),
        ("train.seed=-1, init_timeout_s=1e20, grad_accum=2**62, data.num_proc=1e6",
         "accepted", bounds, "train.seed=-1 must be in [0, 4294967295]", None),
        ("`model.num_layers=1e9 dry_run=true`", "MemoryError", layers,
         "is larger than any Llama's", None),
        ("`output_dir=` below a file of the user's", "a raw NotADirectoryError traceback",
         below_a_file, "is a file, not a folder", None),
    ]


SECRET = "pa55w0rd-never-written"


def bad_inputs() -> list[dict]:
    rows = []
    for name, before, setup, shows, check in _scenarios():
        cwd = _tmp()
        mine = cwd / "mine"
        args = setup(cwd, mine)
        mine.mkdir(exist_ok=True)
        user = _user_files(mine)
        env = ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "../../x"}
               if "cluster=torchrun" in args else None)
        if args[0] == "-m":  # another module's command line
            import subprocess

            t0 = time.monotonic()
            out = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True,
                                 text=True, timeout=300)
            code, log, seconds = out.returncode, out.stdout + out.stderr, time.monotonic() - t0
        else:
            code, log, seconds = run_cli(cwd, *args, env=env)
        rows.append({"name": name, "before": before, "code": code, "seconds": seconds,
                     "named": shows in log, "lost": _lost(user, mine),
                     "ok": check(cwd, mine) if check else True,
                     "launched": "started" in log and "local rank" in log})
    return rows


def bad_input_markdown(rows: list[dict], command: str) -> str:
    lines = ["", "## Bad input", "",
             f"Each tried with the real command (`{command}`), in a fresh directory: what the "
             "code before did (the first 14: before issue 36, commit 07052ee, by hand; the rest: "
             "before the second round, commit cf1dad2, as its issue reports them), and now: the "
             "exit code, "
             "whether the message names the problem, whether any rank started, and the bytes of "
             "the user's files lost or changed.", "",
             "| input | before | now | time | user data lost |", "|---|---|---|---|---|"]
    for r in rows:
        now = (f"exit {r['code']}, named: {r['named']}, ranks started: {r['launched']}"
               + ("" if r["ok"] else ", CHECK FAILED"))
        lines.append(f"| {r['name']} | {r['before']} | {now} | {r['seconds']:.1f} s (whole "
                     f"command) | {r['lost']} bytes |")
    lost = sum(r["lost"] for r in rows)
    lines += ["", f"{len(rows)} bad inputs tried; user data lost: {lost} bytes."]
    return "\n".join(lines) + "\n"


def markdown(rows: dict, command: str) -> str:
    k0, k1, ints, term, hup = (rows[k] for k in ("kill", "kill_restart", "int", "term", "hup"))
    dint, srv, unr, full, bad = (rows[k] for k in ("int2", "server", "unreachable", "disk",
                                                   "corrupt"))
    lk, sk, second, cache = (rows[k] for k in ("launcher_kill", "supervisor_kill", "second",
                                               "cache"))

    def s(v):
        return "-" if v is None else f"{v:.1f} s"

    lines = [
        "# Reliability: each fault, what happens, how long, what is lost",
        "",
        f"Measured with `{command}` (2 CPU ranks, tiny model, the real command; faults from "
        "tests/faults/hooks.py, a real `mlflow server`, real signals). *Before*: the code "
        "before this work (commit 1d49240); measured by hand the same way unless marked.",
        "",
        "| fault | before | now | time to stop / recover | lost |",
        "|---|---|---|---|---|",
        f"| rank 1 SIGKILLed (the OOM killer) | stopped in 4.5-5 s; the report showed rank 0's "
        f"gloo `Connection reset by peer`, not the rank that died | stopped, the report leads "
        f"with `rank 1 … killed by signal 9 (SIGKILL)` (named: {k0['named']}), exit {k0['code']} "
        f"| {s(k0['stop_s'])} from the report to exit | the steps since the last checkpoint |",
        f"| the same, `cluster.max_restarts=1` | not available: relaunch by hand | every rank "
        f"restarts from the newest checkpoint in the same MLflow run; exit {k1['code']} | "
        f"{s(k1['recover_s'])} from the last step before the kill to the first after the "
        f"restart | {k1['lost_steps']} steps (trained after the last checkpoint) |",
        f"| Ctrl-C | ranks killed mid-step by the submitit controller (by reading the old code) | ranks save at their next "
        f"log step, then stop: checkpoints {ints['checkpoints']}, exit {ints['code']} | "
        f"{s(ints['exit_s'])} to exit, {s(ints['all_gone_s'])} until no process is left | "
        "nothing |",
        f"| Ctrl-C twice | - | every rank stopped at once, exit {dint['code']} | "
        f"{s(dint['exit_s'])}; processes left: {len(dint['left'])} | the steps since the last "
        "checkpoint |",
        f"| SIGTERM to the launcher | launcher exit 143, ranks and controller kept running "
        f"(3 processes still alive 60 s later) | every rank stopped, exit "
        f"{term['code']}; processes left: {len(term['left'])} | {s(term['all_gone_s'])} | the "
        "steps since the last checkpoint |",
        f"| SIGHUP to the launcher | as SIGTERM | every rank stopped, exit {hup['code']}; "
        f"processes left: {len(hup['left'])} | {s(hup['all_gone_s'])} | the steps since the "
        "last checkpoint |",
        f"| MLflow server killed at step 10 | training stalled in urllib3's retries (> 8 min as reported in the issue; not "
        f"re-measured) "
        f"| training went on to step {srv['finished']}, exit {srv['code']}: median step "
        f"{srv['step_ms_before']:.0f} ms before, {srv['step_ms_during']:.0f} ms during the "
        f"outage; replay after restart exit {srv['replay_code']} | - | {srv['lost']} metric "
        "steps |",
        f"| MLflow server unreachable at launch | failed after ~260 s, after every rank had "
        f"built its model | refused before any rank, exit {unr['code']}, with the URI and the "
        f"fix | {s(unr['seconds'])} (whole command) | nothing started |",
        f"| disk full during a save | a raw CheckpointException traceback (by reading the old "
        f"code) | clear error "
        f"({full['clear']}), partial files removed, kept {full['kept']}, exit {full['code']} | "
        f"{s(full['seconds'])} (whole run) | the steps since the kept checkpoint |",
        f"| newest checkpoint truncated | resume failed (or trained from a partly loaded "
        f"state) | skipped with a warning, resumed from the one before (fell back: "
        f"{bad['fell_back']}), exit {bad['code']} | {s(bad['seconds'])} (whole resumed run) "
        "| the steps between the two checkpoints |",
        "| 8 jobs on one fresh sqlite store | parallel schema migrations broke the store "
        "(`table _alembic_tmp_params already exists`) | first open serialized; every metric "
        "delivered (tests/faults/test_tracking_faults.py) | - | nothing |",
        f"| the launcher SIGKILLed (`timeout -s KILL`, the OOM killer) | controller, "
        f"supervisors and ranks trained on to the last step with nobody waiting (all alive "
        f"120 s later) | the chain follows its parent (parent-death signal): processes left "
        f"{len(lk['left'])} of {lk['before']}; newest checkpoint {lk['newest']} intact: "
        f"{lk['intact']} | {s(lk['all_gone_s'])} until no process is left | the steps since "
        "the last checkpoint |",
        f"| rank 1's supervisor SIGKILLed, `cluster.max_restarts=1` | rank 1's training process "
        f"ran on as an orphan; the launcher ended with `has not produced any output`, exit 1 | "
        f"named (`rank 1's supervisor … killed by signal 9`: {sk['named']}), every rank "
        f"restarted from the newest checkpoint, exit {sk['code']}; processes left "
        f"{len(sk['left'])} | {s(sk['recover_s'])} from the kill to the first step after the "
        "restart | the steps since the last checkpoint |",
        f"| a second launch into a live run's directory | waited silently on the tracking lock "
        f"as long as the first run lived (99 s), then started its ranks against the finished "
        f"run | refused at once with the owner's host, pid and start (named: "
        f"{second['named']}), exit {second['code']} | {s(second['seconds'])} (whole command) "
        "| nothing |",
        f"| a tokenized split in the cache truncated | `Expected to be able to read … bytes`, "
        f"exit 2, nothing rebuilt | named in a warning and tokenized again (rebuilt: "
        f"{cache['rebuilt']}), exit {cache['code']} | {s(cache['seconds'])} (whole run) | "
        "nothing |",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "reliability.md")
    p.add_argument("--only-bad-inputs", action="store_true",
                   help="run the bad-input table alone and replace that section of --out")
    p.add_argument("--only-finished-run-inputs", action="store_true",
                   help="run evaluate's and generate's table alone (one process, about a "
                   "minute) and replace that section of --out")
    p.add_argument("--only-training-inputs", action="store_true",
                   help="run issue 63's training-side table alone (a few minutes) and replace "
                   "that section of --out")
    args = p.parse_args()
    command = "python benchmarks/reliability.py"
    text = args.out.read_text() if args.out.exists() else ""
    finished_cmd = command + " --only-finished-run-inputs"
    if args.only_finished_run_inputs:
        rows = finished_run.rows()
        for row in rows:
            print("finished-run input", {k: v for k, v in row.items() if k != "log"})
        head = text.split("\n" + finished_run.HEADER)[0].rstrip("\n") + "\n"
        args.out.write_text(head + finished_run.markdown(rows, finished_cmd))
        print(f"wrote {args.out}")
        return
    if args.only_training_inputs:
        rows = training.rows()
        for row in rows:
            print("training input", row)
        assert not leftovers("reliability-"), leftovers("reliability-")
        head, found, rest = text.partition("\n" + training.HEADER + "\n")
        tail = ("\n" + rest.split("\n## ", 1)[1] if "\n## " in rest else "") if found else ""
        args.out.write_text(head.rstrip("\n") + "\n" + training.markdown(
            rows, command + " --only-training-inputs") + (("\n## " + tail.lstrip("\n"))
                                                          if tail else ""))
        print(f"wrote {args.out}")
        return
    bad = bad_inputs()
    for row in bad:
        print("bad input", row)
    assert not leftovers("reliability-"), leftovers("reliability-")
    if args.only_bad_inputs:
        head = text.split("\n## Bad input\n")[0].rstrip("\n") + "\n"
        kept = text.partition("\n" + finished_run.HEADER)
        args.out.write_text(head + bad_input_markdown(bad, command + " --only-bad-inputs")
                            + (kept[1] + kept[2] if kept[1] else ""))
        print(f"wrote {args.out}")
        return
    rows = {"kill": killed_rank(0), "kill_restart": killed_rank(1),
            "int": signal_launcher(signal.SIGINT), "int2": signal_launcher(signal.SIGINT, True),
            "term": signal_launcher(signal.SIGTERM), "hup": signal_launcher(signal.SIGHUP),
            "server": server_outage(), "unreachable": unreachable(), "disk": disk_full(),
            "corrupt": corrupt_newest(), "launcher_kill": launcher_sigkill(),
            "supervisor_kill": supervisor_sigkill(), "second": second_launch(),
            "cache": damaged_cache()}
    for name, row in rows.items():
        print(name, row)
    assert not leftovers("reliability-"), leftovers("reliability-")
    finished = finished_run.rows()
    args.out.write_text(markdown(rows, command) + bad_input_markdown(bad, command)
                        + finished_run.markdown(finished, finished_cmd))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
