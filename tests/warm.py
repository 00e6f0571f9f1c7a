"""`python -m llama_fsdp...` for the tests, forked from an interpreter that has imported torch,
transformers, MLflow and llama_fsdp once, instead of a new interpreter importing them again.

Half of a short run's CPU on these 2 cores was imports: about 4.5 s for torch and transformers
in the job's controller and 3 s for Hydra, MLflow and its store in the command itself, paid by
some 300 launches in the suite. Here a test runs the command through ``PYTHON`` (a small
client, written at the session's start) where it would run ``sys.executable``, or puts
``BIN`` first on PATH so that ``python`` in a shell command is the client. The client asks a
warm server (the "zygote": one per set of import-time environment variables, started on
demand, one per pytest worker) to fork a process that runs the module as ``python -m`` does:
with the client's arguments, working directory, environment and standard streams, in a session
of its own, as ``__main__``, ending the way the command ends (launchers/process.exit_now). The
client stays the process the test holds: it forwards the signals it gets to the command's
process group, exits with its exit code (or dies of its signal), and when the client is killed
the command is killed with it. Inside the command ``sys.executable`` is the client, so the
local launcher's job controller (``-m llama_fsdp.launchers.controller``) is forked warm too.

Anything else (``-c``, a script, flags the client does not know, a SLURM job step, a memory
shim in LD_PRELOAD) is passed to the real interpreter with ``exec``: it is that process.
Tests about process boundaries (the fault suite's kills, orphans and parent deaths, SLURM,
torchrun's agents) start real interpreters, as before.

The client's half of this file imports only the standard library (it runs as ``python -S -E``).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import time

# the environment variables read when Python, glibc, torch, transformers, datasets or
# huggingface_hub start (not later, where a forked command reads its own): a zygote serves only
# commands whose values of these are the ones it started with
IMPORT_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_", "TORCH_LOGS", "TORCHDYNAMO_",
              "TORCHINDUCTOR_", "PYTHON", "LD_", "MALLOC_", "GLIBC_", "XDG_", "HOME", "TMPDIR",
              "MLFLOW_LOGGING", "CUDA_VISIBLE_DEVICES")
# run cold: a SLURM job step (it is about its own processes), a malloc shim (must be in from exec)
COLD_ENV = ("SLURM_JOB_ID", "LD_PRELOAD", "LLAMA_FSDP_TEST_COLD")
DIR_ENV = "LLAMA_FSDP_TEST_WARM_DIR"  # where the zygotes' sockets are (one per pytest worker)
REAL_ENV = "LLAMA_FSDP_TEST_REAL_PYTHON"  # the interpreter the client stands for
OWNER_ENV = "LLAMA_FSDP_TEST_WARM_OWNER"  # the pytest process the zygotes die with
PRELOAD = ("llama_fsdp.cli", "llama_fsdp.train.worker", "llama_fsdp.launchers.controller",
           "llama_fsdp.prepare.job", "llama_fsdp.evaluate", "llama_fsdp.generate",
           "llama_fsdp.tracking.__main__", "mlflow.store.tracking.sqlalchemy_store",
           "mlflow.tracking", "datasets")
IDLE_S = 900  # a zygote nobody asked for this long ends


# --- the client (stdlib only) --------------------------------------------------------------------


def _module_of(argv: list[str]) -> tuple[str, list[str], dict[str, str]] | None:
    """(module, its arguments, environment it implies) of ``python [-u] [-B] -m module args``
    for a llama_fsdp module; None for anything else."""
    extra: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i] in ("-u", "-B"):
        extra.update({"-u": {"PYTHONUNBUFFERED": "1"}, "-B": {}}[argv[i]])
        i += 1
    if i + 1 >= len(argv) or argv[i] != "-m":
        return None
    module = argv[i + 1]
    if module != "llama_fsdp" and not module.startswith("llama_fsdp."):
        return None
    return module, argv[i + 2:], extra


def _key(env: dict[str, str]) -> str:
    seen = sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_ENV))
    return hashlib.sha1(json.dumps([env[REAL_ENV], seen]).encode()).hexdigest()[:16]


def _connect(warm_dir: str, key: str, env: dict[str, str]) -> socket.socket:
    """A connection to the zygote for ``key``, started (with ``env``) if there is none."""
    path = os.path.join(warm_dir, key + ".sock")
    for attempt in range(2):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return s
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
        if attempt == 0:
            _start_zygote(warm_dir, key, env, path)
    raise RuntimeError(f"the warm interpreter {path} did not start: see {path[:-5]}.log")


def _start_zygote(warm_dir: str, key: str, env: dict[str, str], path: str) -> None:
    import fcntl
    import subprocess

    with open(os.path.join(warm_dir, key + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one start per key, however many clients ask at once
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)  # started meanwhile by another client
                return
            except ConnectionRefusedError:  # a zygote that died: its socket goes
                os.unlink(path)
            finally:
                probe.close()
        with open(os.path.join(warm_dir, key + ".log"), "a") as log:
            proc = subprocess.Popen([env[REAL_ENV], os.path.abspath(__file__), "serve", path],
                                    env=env, cwd=warm_dir, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=log, start_new_session=True)
        while not os.path.exists(path):  # bound under a temporary name, renamed once ready
            if proc.poll() is not None:
                raise RuntimeError(f"the warm interpreter exited {proc.returncode}: see "
                                   f"{path[:-5]}.log")
            time.sleep(0.05)


def client(real: str, argv: list[str]) -> None:
    """The ``python`` a test runs: the command forked warm, or the real interpreter ``real``
    exec'd."""
    env = dict(os.environ)
    env[REAL_ENV] = real
    parsed = _module_of(argv)
    if parsed is None or not env.get(DIR_ENV) or any(env.get(k) for k in COLD_ENV):
        os.execv(real, [real, *argv])
    module, args, extra = parsed
    env.update(extra)
    pending: list[int] = []
    forward = signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, \
        signal.SIGUSR2, signal.SIGCONT
    for sig in forward:  # before the command exists: kept, and sent once it does
        signal.signal(sig, lambda s, _f: pending.append(s))
    conn = _connect(env[DIR_ENV], _key(env), env)
    request = json.dumps({"module": module, "args": args, "cwd": os.getcwd(), "env": env,
                          "argv0": real, "title": " ".join([real, *argv]),
                          "client_pid": os.getpid()}).encode()
    socket.send_fds(conn, [b"F"], [0, 1, 2])  # the streams first, alone with their one byte
    conn.sendall(len(request).to_bytes(8, "big") + request)
    reader = conn.makefile("r")
    started = json.loads(reader.readline())  # {"pid": ...}

    def send(s: int) -> None:
        try:
            conn.sendall(f"{s}\n".encode())
        except OSError:
            pass

    for sig in forward:
        signal.signal(sig, lambda s, _f: send(s))
    for s in pending:
        send(s)
    while True:
        try:
            line = reader.readline()
            break
        except InterruptedError:
            continue
    if not line:  # the zygote went away
        sys.stderr.write(f"warm interpreter lost the command (pid {started['pid']})\n")
        os._exit(1)
    code = json.loads(line)["exit"]
    if code < 0:  # died of a signal: so does this process, as the real one would have
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
    os._exit(code & 0xFF)


# --- the pytest side -------------------------------------------------------------------------------


_SHIM: list[str] = []


def python() -> str:
    """The interpreter a test starts ``python -m llama_fsdp...`` with: the client once
    ``setup`` ran in this process, else this interpreter."""
    return _SHIM[0] if _SHIM else sys.executable


def bin_dirs() -> list[str]:
    """[the client's folder] once ``setup`` ran in this process (put it first on PATH), else []."""
    return [os.path.dirname(_SHIM[0])] if _SHIM else []


def setup(base_dir: str) -> tuple[str, str]:
    """Write the client into ``base_dir`` (bin/python); returns (the client, its bin/). The
    environment of this process is set so that commands started from it use it."""
    bin_dir = os.path.join(base_dir, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    real = os.environ.get(REAL_ENV) or sys.executable
    shim = os.path.join(bin_dir, "python")
    with open(shim + ".tmp", "w") as f:
        f.write(f"#!/bin/sh\nexec {real} -S -E {os.path.abspath(__file__)} client {real} \"$@\"\n")
    os.chmod(shim + ".tmp", 0o755)
    os.replace(shim + ".tmp", shim)
    os.environ.update({DIR_ENV: base_dir, REAL_ENV: real, OWNER_ENV: str(os.getpid())})
    _SHIM[:] = [shim]
    return shim, bin_dir


def teardown(base_dir: str) -> None:
    """End the zygotes started from this process (and their commands still running)."""
    for name in os.listdir(base_dir):
        if name.endswith(".pid"):
            try:
                os.killpg(int(open(os.path.join(base_dir, name)).read()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        if name.endswith((".sock", ".pid")):
            os.unlink(os.path.join(base_dir, name))
    _SHIM.clear()


# --- the zygote ------------------------------------------------------------------------------------


def serve(path: str) -> None:
    """Import PRELOAD, then fork a command per connection until the owner is gone or idle."""
    import gc
    import importlib

    from reaper import register  # (tests/ is this script's folder)

    owner = int(os.environ[OWNER_ENV])
    with open(path[:-5] + ".pid", "w") as f:
        f.write(str(os.getpid()))
    register(os.getpid())  # the zygote leads its session: it, its waiters, then their commands
    for module in PRELOAD:
        importlib.import_module(module)
    try:  # set up here, while the environment is the one this process started with: a forked
        # command replaces it, after which setproctitle finds no room for a title
        import setproctitle

        setproctitle.setproctitle(setproctitle.getproctitle())
    except ImportError:
        pass
    gc.collect()
    gc.freeze()  # the imports' objects: never scanned (or copied) by the forked commands' gc
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path + ".tmp")
    srv.listen(64)
    os.replace(path + ".tmp", path)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters are reaped by the kernel
    srv.settimeout(5.0)
    last = time.monotonic()
    while True:
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            if not _alive(owner) or time.monotonic() - last > IDLE_S:
                os.unlink(path)
                os._exit(0)
            continue
        last = time.monotonic()
        if os.fork() == 0:
            srv.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _wait_for_command(conn)
        conn.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    marker, fds, _, _ = socket.recv_fds(conn, 1, 3)
    if marker != b"F" or len(fds) != 3:
        raise EOFError
    size = int.from_bytes(_recv_exactly(conn, 8), "big")
    return json.loads(_recv_exactly(conn, size)), fds


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


def _wait_for_command(conn: socket.socket) -> None:
    """The waiter: forks the command, passes signals on, reports how it ended, then exits."""
    try:
        request, fds = _recv_request(conn)
    except (EOFError, OSError):
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run_command(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    pidfd = os.pidfd_open(pid)
    import select

    buf, watched = b"", [conn, pidfd]
    while True:
        ready, _, _ = select.select(watched, [], [])
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
            try:
                conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode()
                             + b"\n")
            except OSError:
                pass
            os._exit(0)
        data = conn.recv(256)
        if not data:  # the client is gone (killed): so is its command
            _signal_command(pid, signal.SIGKILL)
            watched = [pidfd]
            continue
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            _signal_command(pid, int(line))


def _signal_command(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the command leads a session (and group) of its own
    except ProcessLookupError:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _run_command(request: dict, fds: list[int]) -> None:
    """In the forked child: become ``python -m <module> <args>`` as the client ran it."""
    import io
    import runpy
    import traceback

    code: object = 1
    try:
        os.setsid()
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the waiter
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for sig in signal.valid_signals():
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                continue
            try:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                              else signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
        sys.stdout = _stream(1, unbuffered)
        sys.stderr = _stream(2, True)
        sys.executable = os.path.join(os.environ[DIR_ENV], "bin", "python")  # the controller warm
        sys.argv = [request["argv0"], *request["args"]]
        sys.path[0] = request["cwd"]
        try:
            from setproctitle import setproctitle

            setproctitle(request["title"])
        except ImportError:
            pass
        if request["module"] == CONTROLLER:
            _stand_in(request["client_pid"])
        sys.modules.pop(request["module"], None)  # as in a new interpreter: run, not imported
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends an interpreter
        traceback.print_exc()
        code = 1
    from llama_fsdp.launchers.process import exit_now

    try:
        exit_now(code if isinstance(code, (int, str)) or code is None else 1)
    finally:
        os._exit(1)


CONTROLLER = "llama_fsdp.launchers.controller"


def _stand_in(client_pid: int) -> None:
    """The local job's controller knows itself by its process id, which is the job id the
    launcher gave its files; the process the launcher started is the client, so the forked
    controller takes the client's (as submitit's own does when a shell stands between)."""
    from submitit.local import local

    init = local.Controller.__init__

    def __init__(self, folder):
        init(self, folder)
        self.pid = str(client_pid)

    local.Controller.__init__ = __init__


def _stream(fd: int, unbuffered: bool):
    import io

    raw = io.FileIO(fd, "w", closefd=False)
    line = os.isatty(fd)
    return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8",
                            errors="backslashreplace", line_buffering=line,
                            write_through=unbuffered)


if __name__ == "__main__":
    if sys.argv[1] == "client":
        client(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "serve":
        serve(sys.argv[2])
