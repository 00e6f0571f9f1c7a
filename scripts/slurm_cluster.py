#!/usr/bin/env python3
"""A real, throwaway SLURM cluster on this one machine, for integration tests.

    python scripts/slurm_cluster.py up [--nodes N] [--cpus-per-node C] [--state-dir DIR]
    python scripts/slurm_cluster.py status [--state-dir DIR]
    python scripts/slurm_cluster.py down [--state-dir DIR] [--purge]
    python scripts/slurm_cluster.py reap      # clusters of test sessions that were killed
    python scripts/slurm_cluster.py list      # clusters registered on this machine
    export SLURM_CONF=DIR/slurm.conf      # or: source DIR/env.sh

What `up` starts (all private to DIR, nothing under /etc is touched; needs root):

* its own ``munged`` (private key and socket; Slurm points at it with ``AuthInfo=socket=``);
* a private MariaDB (``mariadbd`` on 127.0.0.1, its own datadir) and ``slurmdbd``: real
  accounting, so ``sacct`` -- which submitit polls -- reports FAILED / CANCELLED / TIMEOUT for a
  job that dies without writing its result, instead of UNKNOWN forever;
* ``slurmctld`` in the root network namespace, listening on the bridge address;
* N ``slurmd`` nodes ``node1..nodeN``, each in its own network namespace (own hostname via
  ``unshare --uts``, own /etc/hosts via ``unshare --mount`` + bind mount) on a Linux bridge with
  a private /24 ``10.77.K.0/24`` (K is picked so several clusters can coexist); nodes have no
  default route: their traffic stays on the bridge.

Partition ``debug`` (default) holds every node. Nodes advertise ``--cpus-per-node`` CPUs (4 by
default, oversubscribing the host's cores: all nodes share them) and the host's memory.

``up`` on an existing state folder tears the old cluster down first; ``down`` stops daemons by
their pid files (checking /proc/PID/comm), kills what is left in the cluster's namespaces,
deletes namespaces, veths and bridge, and never fails on a half-up cluster.

Outside DIR it uses only: /run/lock/llama-fsdp-slurm.lock (serialises `up`s), one entry per
live cluster in /run/llama-fsdp-slurm/ (so `reap`, and every `up`, can tear down clusters whose
owning test session died), and /var/tmp/llama-fsdp-slurm/ (MariaDB datadir templates, one with
the accounting database already created: the first `up` on a machine takes ~3 s longer, and
the second ~2 s longer while it builds the second template; later ones ~2 s in all).

Stdlib only, importable: ``up()``, ``down()``, ``status()`` and ``Cluster`` are the Python API
(used by tests/integration/conftest.py).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

DEFAULT_STATE_DIR = Path("/tmp/llama-fsdp-slurm")
PARTITION = "debug"
SUBNET_PREFIX = "10.77"          # clusters live in 10.77.K.0/24, K in 0..254
LOCK_FILE = Path("/run/lock/llama-fsdp-slurm.lock")
REGISTRY = Path("/run/llama-fsdp-slurm")   # one K.json per live cluster (for reap_orphans)
DB_TEMPLATE_ROOT = Path("/var/tmp/llama-fsdp-slurm")  # initialised MariaDB datadir, reused
SLURMD_PORT = 6818               # one slurmd per network namespace: no clash
# Slurm's ClusterName, the same for every cluster (each has its own database): the accounting
# database created for the first cluster on a machine is cached as an SQL dump and loaded by
# the next ones, which saves slurmdbd's ~2-3 s of table creation per `up`.
SLURM_CLUSTER_NAME = "llamafsdp"
REQUIRED_BINARIES = ("slurmctld", "slurmd", "slurmdbd", "sbatch", "sinfo", "sacct", "sacctmgr",
                     "scontrol", "munged", "munge", "mariadbd", "mariadb-install-db", "mariadb",
                     "mariadb-dump", "mariadb-admin",
                     "ip", "nsenter", "unshare")

Log = Callable[[str], None]


class ClusterError(RuntimeError):
    """`up` could not bring the cluster to a usable state (it has been torn down again)."""


def _quiet(_: str) -> None:
    pass


# --------------------------------------------------------------------------------------------
# the cluster description (written to STATE/cluster.json before anything is created, so that
# `down` can undo a half-finished `up`)
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Cluster:
    state_dir: Path
    index: int                       # K in 10.77.K.0/24; names derive from it
    nodes: list[str]
    cpus_per_node: int
    real_memory_mb: int
    partition: str
    controller_host: str             # this machine's short hostname
    ports: dict[str, int]            # slurmctld, slurmdbd, mariadb
    extra_conf: list[str] = dataclasses.field(default_factory=list)
    token: str = dataclasses.field(default_factory=lambda: secrets.token_hex(4))
    started_at: float = 0.0
    # job ids start at a random number per cluster start, so a job id from an earlier cluster
    # (submitit caches states by id, and result files are named by id) is never reused
    first_job_id: int = dataclasses.field(default_factory=lambda: 10_000 + secrets.randbelow(9_000_000))
    owner_pid: int | None = None     # `reap_orphans` tears the cluster down once it is gone
    owner_start: int | None = None   # its start time (guards against pid reuse)
    pids: dict[str, int] = dataclasses.field(default_factory=dict)  # recorded after `up`

    # --- names and addresses -------------------------------------------------------------
    @property
    def name(self) -> str:           # a label for logs; Slurm's ClusterName is SLURM_CLUSTER_NAME
        return f"lfs{self.index}"

    @property
    def subnet(self) -> str:
        return f"{SUBNET_PREFIX}.{self.index}"

    @property
    def controller_addr(self) -> str:
        return f"{self.subnet}.1"

    def node_addr(self, i: int) -> str:   # i: 0-based
        return f"{self.subnet}.{i + 2}"

    @property
    def bridge(self) -> str:
        return f"lfsbr{self.index}"

    def netns(self, i: int) -> str:
        return f"lfs{self.index}-{self.nodes[i]}"

    def veth(self, i: int) -> str:        # host end; the namespace end is renamed eth0
        return f"lfs{self.index}v{i + 1}"

    # --- files ----------------------------------------------------------------------------
    @property
    def slurm_conf(self) -> Path:
        return self.state_dir / "slurm.conf"

    @property
    def env_file(self) -> Path:
        return self.state_dir / "env.sh"

    @property
    def munge_socket(self) -> Path:
        return self.state_dir / "munge" / "munged.sock"

    @property
    def db_socket(self) -> Path:
        return self.state_dir / "db" / "mysqld.sock"

    def pid_files(self) -> list[tuple[str, Path]]:
        """(expected /proc/PID/comm, pid file) in stop order."""
        s = self.state_dir
        out = [("slurmd", s / "nodes" / n / "slurmd.pid") for n in self.nodes]
        out += [("slurmctld", s / "ctld" / "slurmctld.pid"), ("slurmdbd", s / "dbd" / "slurmdbd.pid"),
                ("mariadbd", s / "db" / "mysqld.pid"), ("munged", s / "munge" / "munged.pid")]
        return out

    @property
    def env(self) -> dict[str, str]:
        """What to add to os.environ so sbatch / squeue / sinfo / sacct use this cluster."""
        return {"SLURM_CONF": str(self.slurm_conf)}

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["state_dir"] = str(self.state_dir)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Cluster":
        d = dict(d)
        d["state_dir"] = Path(d["state_dir"])
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in fields})

    def save(self) -> None:
        """Write STATE/cluster.json and the host-wide registry entry."""
        text = json.dumps(self.to_json(), indent=2)
        for target in (self.state_dir / "cluster.json", REGISTRY / f"{self.index}.json"):
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + f".tmp{os.getpid()}")
            tmp.write_text(text)
            tmp.replace(target)

    @classmethod
    def load(cls, state_dir: Path) -> "Cluster | None":
        try:
            return cls.from_json(json.loads((Path(state_dir) / "cluster.json").read_text()))
        except (OSError, ValueError, TypeError):
            return None


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------

def _run(cmd: Sequence[str], *, timeout: float = 30, check: bool = True,
         env: dict | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                           env=env, input=input, stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"timed out after {timeout}s: {' '.join(cmd)}") from e
    if check and p.returncode != 0:
        raise ClusterError(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout}{p.stderr}".rstrip())
    return p


def _try_run(cmd: Sequence[str], timeout: float = 15) -> subprocess.CompletedProcess:
    """_run that never raises (teardown paths): a timeout or a missing binary is rc -1."""
    try:
        return _run(cmd, timeout=timeout, check=False)
    except (ClusterError, OSError) as e:
        return subprocess.CompletedProcess(list(cmd), -1, "", str(e))


def _wait(what: str, predicate: Callable[[], bool], timeout: float, interval: float = 0.05,
          on_timeout: Callable[[], str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except Exception:  # noqa: BLE001 - keep polling until the deadline
            pass
        if time.monotonic() > deadline:
            detail = ""
            if on_timeout is not None:
                with contextlib.suppress(Exception):
                    detail = "\n" + on_timeout()
            raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)
        interval = min(interval * 1.5, 0.5)


def _tail(path: Path, n: int = 25) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return f"({path}: no log)"
    return f"--- last lines of {path} ---\n" + "\n".join(lines[-n:])


def _read_pid(path: Path) -> int | None:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, comm: str | None = None) -> bool:
    """True if pid runs (zombies count as dead) and, when given, its comm is `comm`."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat[stat.rindex(")") + 2] in "ZX":
            return False
        if comm is not None and Path(f"/proc/{pid}/comm").read_text().strip() != comm[:15]:
            return False
        return True
    except (OSError, ValueError, IndexError):
        return False


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _stop_pids(pids: dict[int, str | None], grace: float) -> list[int]:
    """SIGTERM pids (checked against comm), SIGKILL after `grace`; returns pids still alive."""
    pids = {p: c for p, c in pids.items() if p > 1 and p != os.getpid() and _alive(p, c)}
    for p in pids:
        _kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p, c) for p, c in pids.items()):
        time.sleep(0.05)
    left = [p for p, c in pids.items() if _alive(p, c)]
    for p in left:
        _kill(p, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(p) for p in left):
        time.sleep(0.05)
    return [p for p in left if _alive(p)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def missing_requirements() -> list[str]:
    """Why this machine cannot run a cluster ([] if it can)."""
    problems = []
    if os.geteuid() != 0:
        problems.append("not root (network namespaces, bridges and slurmd need root)")
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [b for b in REQUIRED_BINARIES if shutil.which(b, path=path) is None]
    if missing:
        problems.append("missing binaries: " + " ".join(missing) + " (run .ci/slurm_deps.sh)")
    return problems


@contextlib.contextmanager
def _host_lock(timeout: float):
    """Serialise `up`s on this machine (subnet and port choice, bridge creation)."""
    LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK_FILE, "a+") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    raise ClusterError(f"could not lock {LOCK_FILE} within {timeout}s") from e
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _used_indices() -> set[int]:
    used = set()
    out = _run(["ip", "-o", "-4", "addr"], check=False).stdout
    for tok in out.split():
        if tok.startswith(SUBNET_PREFIX + "."):
            with contextlib.suppress(ValueError, IndexError):
                used.add(int(tok.split(".")[2]))
    out = _run(["ip", "-o", "link"], check=False).stdout
    for line in out.splitlines():
        parts = line.split(":")
        if len(parts) > 1 and parts[1].strip().startswith("lfsbr"):
            with contextlib.suppress(ValueError):
                used.add(int(parts[1].strip().split("@")[0][5:]))
    netns = _run(["ip", "netns", "list"], check=False).stdout
    for line in netns.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith("lfs") and "-" in name:
            with contextlib.suppress(ValueError):
                used.add(int(name[3:name.index("-")]))
    # clusters registered on this machine own their index even if their bridge is gone
    for entry in REGISTRY.glob("*.json") if REGISTRY.is_dir() else []:
        with contextlib.suppress(ValueError):
            used.add(int(entry.stem))
    return used


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _mem_total_mb() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 4096


# --------------------------------------------------------------------------------------------
# configuration files
# --------------------------------------------------------------------------------------------

def _slurm_conf(c: Cluster) -> str:
    s = c.state_dir
    lines = [
        f"# generated by scripts/slurm_cluster.py -- cluster {c.name}",
        f"ClusterName={SLURM_CLUSTER_NAME}",
        f"SlurmctldHost={c.controller_host}({c.controller_addr})",
        f"SlurmctldPort={c.ports['slurmctld']}",
        f"SlurmdPort={SLURMD_PORT}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire also sets how long a requeued job waits before it may start again
        # (default 120 s): 10 s keeps the requeue tests short on a cluster this small, and
        # leaves a loaded machine 10 s to start a job step with its credential
        f"AuthInfo=socket={c.munge_socket},cred_expire=10",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        # nodes advertise the configured CPUs / memory, not the host's (they share its cores)
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "MpiDefault=none",
        "SchedulerType=sched/backfill",
        # a requeued job starts once its wait is over, at the next scheduling pass: every 2 s,
        # not every 60 s (sched_interval's default)
        "SchedulerParameters=batch_sched_delay=0,sched_interval=2",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=60",
        "MessageTimeout=20",
        "InactiveLimit=0",
        "KillWait=5",
        "MinJobAge=300",
        f"FirstJobId={c.first_job_id}",
        "Waittime=0",
        f"StateSaveLocation={s}/ctld/state",
        f"SlurmctldPidFile={s}/ctld/slurmctld.pid",
        f"SlurmctldLogFile={s}/ctld/slurmctld.log",
        "SlurmctldDebug=info",
        f"SlurmdSpoolDir={s}/nodes/%n/spool",
        f"SlurmdPidFile={s}/nodes/%n/slurmd.pid",
        f"SlurmdLogFile={s}/nodes/%n/slurmd.log",
        "SlurmdDebug=info",
        # accounting through our slurmdbd: sacct (submitit's job state) sees every job
        "AccountingStorageType=accounting_storage/slurmdbd",
        f"AccountingStorageHost={c.controller_addr}",
        f"AccountingStoragePort={c.ports['slurmdbd']}",
        f"AccountingStoragePass={c.munge_socket}",  # the munge socket; sacctmgr hangs without
        "JobCompType=jobcomp/none",
    ]
    for i, n in enumerate(c.nodes):
        lines.append(f"NodeName={n} NodeAddr={c.node_addr(i)} NodeHostname={n} CPUs={c.cpus_per_node} "
                     f"RealMemory={c.real_memory_mb} State=UNKNOWN")
    lines.append(f"PartitionName={c.partition} Nodes={','.join(c.nodes)} Default=YES "
                 "MaxTime=INFINITE State=UP")
    lines += list(c.extra_conf)
    return "\n".join(lines) + "\n"


def _slurmdbd_conf(c: Cluster, db_password: str) -> str:
    s = c.state_dir
    return "\n".join([
        "AuthType=auth/munge",
        f"AuthInfo=socket={c.munge_socket}",
        "DbdHost=localhost",
        f"DbdPort={c.ports['slurmdbd']}",
        "SlurmUser=root",
        f"PidFile={s}/dbd/slurmdbd.pid",
        f"LogFile={s}/dbd/slurmdbd.log",
        "DebugLevel=info",
        "StorageType=accounting_storage/mysql",
        "StorageHost=127.0.0.1",
        f"StoragePort={c.ports['mariadb']}",
        "StorageUser=slurm",
        f"StoragePass={db_password}",
        "StorageLoc=slurm_acct_db",
    ]) + "\n"


def _hosts(c: Cluster) -> str:
    lines = ["127.0.0.1 localhost", f"{c.controller_addr} {c.controller_host}"]
    lines += [f"{c.node_addr(i)} {n}" for i, n in enumerate(c.nodes)]
    return "\n".join(lines) + "\n"


_MARIADB_OPTS = [
    "--skip-name-resolve", "--skip-log-bin", "--innodb-buffer-pool-size=32M",
    "--innodb-log-file-size=8M", "--innodb-flush-log-at-trx-commit=0", "--innodb-doublewrite=0",
    "--innodb-flush-method=nosync", "--performance-schema=0", "--max-connections=50",
]


# --------------------------------------------------------------------------------------------
# up
# --------------------------------------------------------------------------------------------

def _spawn_detached(cmd: Sequence[str], log_path: Path, env: dict | None = None,
                    timeout: float = 30) -> None:
    """Run `cmd` so that it outlives us and is not our child (daemons fork; others are
    backgrounded by a throwaway shell). Waits for the launching process only."""
    with open(log_path, "ab") as log:
        p = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                             start_new_session=True, env=env, close_fds=True)
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)
        raise ClusterError(f"launcher did not return within {timeout}s: {' '.join(cmd)}\n"
                           + _tail(log_path))
    if rc != 0:
        raise ClusterError(f"failed to start ({rc}): {' '.join(cmd)}\n" + _tail(log_path))


def _version_tag(cmd: Sequence[str], word: int) -> str:
    out = _run(cmd, check=False).stdout.split()
    raw = out[word] if len(out) > word else "x"
    return "".join(ch if ch.isalnum() or ch in ".-" else "_" for ch in raw)


def _acct_dump_path() -> Path:
    """Cached SQL dump of a fresh accounting database (per Slurm and MariaDB version)."""
    return DB_TEMPLATE_ROOT / (f"acct-slurm-{_version_tag(['slurmctld', '-V'], 1)}-"
                               f"mariadb-{_version_tag(['mariadbd', '--version'], 2)}.sql")


def _db_template(log: Log, timeout: float) -> tuple[Path, bool]:
    """An initialised MariaDB datadir to copy, and whether it already holds the accounting
    database (with the cluster registered). Made once per machine and version, in two steps:
    a bare datadir (mariadb-install-db, ~3 s); once an `up` has cached the accounting database
    as an SQL dump, the bare datadir plus that dump (~2 s, on the next `up`)."""
    mariadb_tag = _version_tag(["mariadbd", "--version"], 2)
    bare = DB_TEMPLATE_ROOT / f"mariadb-{mariadb_tag}"
    dump = _acct_dump_path()
    full = DB_TEMPLATE_ROOT / dump.name.replace(".sql", ".datadir")
    if (full / "slurm_acct_db").is_dir():
        return full, True
    DB_TEMPLATE_ROOT.mkdir(parents=True, exist_ok=True)
    if not (bare / "mysql").is_dir():
        tmp = DB_TEMPLATE_ROOT / f".tmp-{os.getpid()}-{secrets.token_hex(3)}"
        log(f"initialising a MariaDB datadir template {bare} (once per machine)")
        p = _run(["mariadb-install-db", "--no-defaults", f"--datadir={tmp}", "--user=root",
                  "--auth-root-authentication-method=normal", "--skip-test-db",
                  *_MARIADB_OPTS[:7]], timeout=timeout, check=False)
        if p.returncode != 0 or not (tmp / "mysql").is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
            raise ClusterError(f"mariadb-install-db failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
        try:
            tmp.rename(bare)
        except OSError:                  # another process made it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    if dump.exists():
        try:
            _build_full_template(bare, dump, full, log, timeout)
            return full, True
        except Exception as e:  # noqa: BLE001 - the bare template still works, only slower
            log(f"could not build {full}: {e}")
    return bare, False


def _build_full_template(bare: Path, dump: Path, full: Path, log: Log, timeout: float) -> None:
    log(f"building the MariaDB template with the accounting database {full} (once per machine)")
    tmp = Path(f"/tmp/.lfs-dbt-{os.getpid()}-{secrets.token_hex(3)}")   # short socket path
    datadir = tmp / "data"
    tmp.mkdir(mode=0o700)
    proc = None
    try:
        _run(["cp", "-a", str(bare), str(datadir)], timeout=timeout)
        sock = tmp / "s.sock"
        with open(tmp / "log", "ab") as logf:
            proc = subprocess.Popen(
                ["mariadbd", "--no-defaults", "--user=root", f"--datadir={datadir}",
                 f"--socket={sock}", "--skip-networking", f"--pid-file={tmp}/pid",
                 f"--log-error={tmp}/err.log", *_MARIADB_OPTS],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)
        sql = ["mariadb", "--no-defaults", f"--socket={sock}", "-uroot"]
        _wait("template mariadb", lambda: _run([*sql, "-e", "select 1"], timeout=5,
                                               check=False).returncode == 0,
              timeout=min(60, timeout), on_timeout=lambda: _tail(tmp / "err.log"))
        _run(sql, input=dump.read_text(), timeout=timeout)
        _run(["mariadb-admin", "--no-defaults", f"--socket={sock}", "-uroot", "shutdown"],
             timeout=60)
        proc.wait(timeout=60)
        proc = None
        staging = DB_TEMPLATE_ROOT / f".tmp-{os.getpid()}-{secrets.token_hex(3)}"
        shutil.move(str(datadir), str(staging))
        try:
            staging.rename(full)
        except OSError:                  # another process made it meanwhile
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        if proc is not None:
            proc.kill()
            with contextlib.suppress(Exception):
                proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def up(state_dir: Path | str = DEFAULT_STATE_DIR, nodes: int = 2, cpus_per_node: int = 4,
       partition: str = PARTITION, extra_conf: Iterable[str] = (), timeout: float = 120,
       owner_pid: int | None = None, log: Log = _quiet) -> Cluster:
    """Bring up a fresh cluster in `state_dir` (tearing down whatever was there) and return it
    once every node is idle and accounting answers. On failure everything started is stopped
    again and ClusterError is raised (with the relevant log tails).

    owner_pid: when given (a test session's pid), a later `up` or `reap_orphans()` on this
    machine tears the cluster down once that process is gone (a killed pytest leaves nothing
    running for long). `extra_conf`: lines appended to slurm.conf."""
    problems = missing_requirements()
    if problems:
        raise ClusterError("; ".join(problems))
    if not 1 <= nodes <= 200:
        raise ClusterError(f"--nodes must be 1..200, got {nodes}")
    state_dir = Path(state_dir).absolute()
    if len(str(state_dir)) > 70:   # unix sockets (munge, mysql) live under it: 108-byte limit
        raise ClusterError(f"state dir path too long for unix sockets (max 70 chars): {state_dir}")
    if not all(ch.isalnum() or ch in "/._+-" for ch in str(state_dir)):
        raise ClusterError(f"state dir path must be plain (letters, digits, / . _ + -): slurm.conf "
                           f"cannot quote it: {str(state_dir)!r}")
    t0 = time.monotonic()
    deadline = t0 + timeout

    def left() -> float:
        return max(1.0, deadline - time.monotonic())

    if state_dir.exists():
        entries = {p.name for p in state_dir.iterdir()}
        if entries and not entries & {"cluster.json", "slurm.conf", "munge", "ctld", "nodes"}:
            raise ClusterError(f"{state_dir} is not empty and does not look like a cluster state "
                               "folder; refusing to wipe it")
        if entries:
            down(state_dir, log=log)
        for child in state_dir.iterdir():       # keep the folder itself (may be a fixture's)
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(state_dir, 0o755)

    with _host_lock(timeout=left()):
        reap_orphans(log=log)
        used = _used_indices()
        index = next((k for k in range(255) if k not in used), None)
        if index is None:
            raise ClusterError(f"no free {SUBNET_PREFIX}.K.0/24 subnet")
        ports: dict[str, int] = {}
        while len(set(ports.values())) < 3:
            ports = {"slurmctld": _free_port(), "slurmdbd": _free_port(), "mariadb": _free_port()}
        c = Cluster(state_dir=state_dir, index=index, nodes=[f"node{i + 1}" for i in range(nodes)],
                    cpus_per_node=cpus_per_node, real_memory_mb=_mem_total_mb(),
                    partition=partition, controller_host=socket.gethostname().split(".")[0],
                    ports=ports, extra_conf=list(extra_conf), started_at=time.time(),
                    owner_pid=owner_pid, owner_start=_start_time(owner_pid) if owner_pid else None)
        for sub in ("munge", "db", "dbd", "ctld/state", *(f"nodes/{n}/spool" for n in c.nodes)):
            (state_dir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(state_dir / "munge", 0o700)
        c.save()                         # from here on, `down` knows what to undo
        try:
            _bring_up(c, log, left)
            c.pids = {f"{comm}:{pf.parent.name}" if comm == "slurmd" else comm: pid
                      for comm, pf in c.pid_files() if (pid := _read_pid(pf)) is not None}
            c.save()
        except BaseException as e:
            log(f"up failed, tearing down: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            down(state_dir, log=log)
            raise
    log(f"cluster {c.name} up in {time.monotonic() - t0:.1f}s: {len(c.nodes)} nodes on "
        f"{c.subnet}.0/24, partition {c.partition}")
    return c


def _bring_up(c: Cluster, log: Log, left: Callable[[], float]) -> None:
    s = c.state_dir
    t = time.monotonic()
    slurm_env = {**os.environ, "SLURM_CONF": str(c.slurm_conf)}

    # config files first: daemons read them
    db_password = secrets.token_hex(12)
    c.slurm_conf.write_text(_slurm_conf(c))
    dbd_conf = s / "slurmdbd.conf"       # slurmdbd finds it next to $SLURM_CONF
    dbd_conf.write_text(_slurmdbd_conf(c, db_password))
    os.chmod(dbd_conf, 0o600)
    hosts = s / "hosts"
    hosts.write_text(_hosts(c))
    c.env_file.write_text("".join(f"export {k}={v}\n" for k, v in c.env.items()))

    # munge: private key and socket
    key = s / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    os.chmod(key, 0o400)
    m = s / "munge"
    _spawn_detached(["munged", f"--socket={c.munge_socket}", f"--key-file={key}",
                     f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
                     f"--seed-file={m}/munged.seed", "--num-threads=4", "--force"],
                    m / "launch.log", timeout=left())

    # MariaDB: copy the initialised template, start in the background
    tpl, cached = _db_template(log, timeout=left())
    datadir = s / "db" / "data"
    _run(["cp", "-a", "--reflink=auto", str(tpl), str(datadir)], timeout=left())
    d = s / "db"
    mysqld = ["mariadbd", "--no-defaults", "--user=root", f"--datadir={datadir}",
              f"--socket={c.db_socket}", f"--port={c.ports['mariadb']}", "--bind-address=127.0.0.1",
              f"--pid-file={d}/mysqld.pid", f"--log-error={d}/mysqld.log", *_MARIADB_OPTS]
    _spawn_detached(["sh", "-c", 'exec "$@" </dev/null >/dev/null 2>&1 &', "sh", *mysqld],
                    d / "launch.log", timeout=left())

    # network: bridge + one namespace per node, no default route
    _net_up(c)
    t_net = time.monotonic()

    _wait("munged", lambda: _run(["munge", "-n", "-S", str(c.munge_socket)], timeout=5,
                                 check=False).returncode == 0,
          timeout=left(), on_timeout=lambda: _tail(m / "munged.log") + "\n" + _tail(m / "launch.log"))
    _wait("mariadb", lambda: c.db_socket.exists() and _port_open("127.0.0.1", c.ports["mariadb"]),
          timeout=left(), on_timeout=lambda: _tail(d / "mysqld.log"))
    sql = ["mariadb", "--no-defaults", f"--socket={c.db_socket}", "-uroot"]
    _run([*sql, "-e", f"CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{db_password}'; "
          "GRANT ALL ON *.* TO 'slurm'@'127.0.0.1';"], timeout=left())
    dump = _acct_dump_path()
    t_db = time.monotonic()

    # slurmdbd, then register the cluster (slurmctld wants it to exist)
    _spawn_detached(["slurmdbd"], s / "dbd" / "launch.log", env=slurm_env, timeout=left())
    _wait("slurmdbd", lambda: _port_open(c.controller_addr, c.ports["slurmdbd"]), timeout=left(),
          on_timeout=lambda: _tail(s / "dbd" / "slurmdbd.log") + "\n" + _tail(s / "dbd" / "launch.log"))

    def registered() -> bool:
        out = _run(["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"], env=slurm_env,
                   timeout=min(20, left()), check=False).stdout.split()
        return SLURM_CLUSTER_NAME in out

    def register() -> bool:
        return _run(["sacctmgr", "-i", "add", "cluster", SLURM_CLUSTER_NAME], env=slurm_env,
                    timeout=min(20, left()), check=False).returncode == 0 or registered()

    _wait("the cluster in accounting (sacctmgr)", registered if cached else register,
          timeout=left(), on_timeout=lambda: _tail(s / "dbd" / "slurmdbd.log"))
    if not cached:                       # cache the fresh database for the next `up`s
        with contextlib.suppress(Exception):
            p = _run(["mariadb-dump", "--no-defaults", f"--socket={c.db_socket}", "-uroot",
                      "--skip-comments", "--databases", "slurm_acct_db"], timeout=min(30, left()))
            dump.parent.mkdir(parents=True, exist_ok=True)
            tmp = dump.with_name(dump.name + f".tmp{os.getpid()}")
            tmp.write_text(p.stdout)
            tmp.replace(dump)
    t_dbd = time.monotonic()

    # controller, then one slurmd per namespace
    _spawn_detached(["slurmctld", "-f", str(c.slurm_conf)], s / "ctld" / "launch.log",
                    env=slurm_env, timeout=left())
    for i, n in enumerate(c.nodes):
        q = shlex.quote
        inner = (f"mount --bind {q(str(hosts))} /etc/hosts && hostname {q(n)} && "
                 f"exec slurmd -f {q(str(c.slurm_conf))} -N {q(n)}")
        _spawn_detached(["nsenter", f"--net=/run/netns/{c.netns(i)}", "unshare", "--uts",
                         "--mount", "--propagation", "private", "sh", "-c", inner],
                        s / "nodes" / n / "launch.log", env=slurm_env, timeout=left())

    def nodes_idle() -> bool:
        out = _run(["sinfo", "-h", "-N", "-o", "%N %T"], env=slurm_env, timeout=10,
                   check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n, "").rstrip("*") == "idle" for n in c.nodes)

    def why() -> str:
        parts = [_run(["sinfo", "-N", "-l"], env=slurm_env, timeout=10, check=False).stdout,
                 _tail(s / "ctld" / "slurmctld.log")]
        parts += [_tail(s / "nodes" / n / "slurmd.log", 10) + "\n" + _tail(s / "nodes" / n / "launch.log", 5)
                  for n in c.nodes]
        return "\n".join(parts)

    _wait("all nodes idle", nodes_idle, timeout=left(), on_timeout=why)
    t_end = time.monotonic()
    log(f"timings: munge+db files+net {t_net - t:.2f}s, mariadb {t_db - t_net:.2f}s, "
        f"slurmdbd {t_dbd - t_db:.2f}s, slurmctld+slurmd {t_end - t_dbd:.2f}s")


def _net_up(c: Cluster) -> None:
    ip = lambda *a: _run(["ip", *a], timeout=15)  # noqa: E731
    ip("link", "add", c.bridge, "type", "bridge")
    ip("addr", "add", f"{c.controller_addr}/24", "dev", c.bridge)
    ip("link", "set", c.bridge, "up")
    for i in range(len(c.nodes)):
        ns, veth = c.netns(i), c.veth(i)
        ip("netns", "add", ns)
        ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
        ip("link", "set", f"{veth}p", "netns", ns)
        ip("link", "set", veth, "master", c.bridge)
        ip("link", "set", veth, "up")
        ip("-n", ns, "link", "set", f"{veth}p", "name", "eth0")
        ip("-n", ns, "addr", "add", f"{c.node_addr(i)}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")


# --------------------------------------------------------------------------------------------
# down / status
# --------------------------------------------------------------------------------------------

def _netns_pids(ns: str) -> list[int]:
    out = _try_run(["ip", "netns", "pids", ns], timeout=10).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def _existing_netns() -> set[str]:
    out = _try_run(["ip", "netns", "list"], timeout=10).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()}


def _link_exists(name: str) -> bool:
    return Path(f"/sys/class/net/{name}").exists()


def down(state_dir: Path | str = DEFAULT_STATE_DIR, grace: float = 3.0, purge: bool = False,
         log: Log = _quiet) -> list[str]:
    """Stop everything the cluster in `state_dir` started. Never raises for a half-up or absent
    cluster; returns a list of problems (empty when all is gone)."""
    state_dir = Path(state_dir).absolute()
    c = Cluster.load(state_dir)
    if c is None and not state_dir.exists():
        return []
    problems = _teardown(c, state_dir, grace, log)
    if purge:
        shutil.rmtree(state_dir, ignore_errors=True)
    return problems


def _teardown(c: Cluster | None, state_dir: Path, grace: float, log: Log) -> list[str]:
    t0 = time.monotonic()
    problems: list[str] = []
    s = state_dir
    if c is not None:
        pidfiles = c.pid_files()
    else:                                 # no description: fall back to the pid file layout
        pidfiles = [("slurmd", p) for p in sorted(s.glob("nodes/*/slurmd.pid"))]
        pidfiles += [("slurmctld", s / "ctld/slurmctld.pid"), ("slurmdbd", s / "dbd/slurmdbd.pid"),
                     ("mariadbd", s / "db/mysqld.pid"), ("munged", s / "munge/munged.pid")]

    # everything inside the node namespaces (slurmd, slurmstepd, job tasks) and the daemons
    namespaces: list[str] = []
    if c is not None:
        try:
            existing = _existing_netns()
            namespaces = [c.netns(i) for i in range(len(c.nodes)) if c.netns(i) in existing]
        except Exception as e:  # noqa: BLE001
            problems.append(f"listing namespaces: {e}")
    targets: dict[int, str | None] = {}
    for ns in namespaces:
        with contextlib.suppress(Exception):
            for pid in _netns_pids(ns):
                targets[pid] = None
    candidates = [(comm, _read_pid(pf)) for comm, pf in pidfiles]
    if c is not None:                     # pids recorded at `up` (pid files may be gone)
        candidates += [(key.split(":")[0], pid) for key, pid in c.pids.items()]
    for comm, pid in candidates:
        if pid is not None and _alive(pid, comm):
            targets[pid] = comm
    # in stages, each SIGTERM then SIGKILL after `grace`: nodes, jobs and the controller; then
    # slurmdbd (the controller flushes to it while stopping); then MariaDB and munge
    stages = [lambda cm: cm not in ("slurmdbd", "mariadbd", "munged"),
              lambda cm: cm == "slurmdbd", lambda cm: cm in ("mariadbd", "munged")]
    stuck = []
    for in_stage in stages:
        stuck += _stop_pids({p: cm for p, cm in targets.items() if in_stage(cm)}, grace)
    if stuck:
        problems.append(f"processes survived SIGKILL: {stuck}")

    # namespaces, veths, bridge
    if c is not None:
        for i in range(len(c.nodes)):
            ns = c.netns(i)
            if ns in namespaces:
                with contextlib.suppress(Exception):
                    for pid in _netns_pids(ns):     # anything that appeared meanwhile
                        _kill(pid, signal.SIGKILL)
                p = _try_run(["ip", "netns", "del", ns], timeout=10)
                if p.returncode != 0:
                    problems.append(f"ip netns del {ns}: {p.stderr.strip()}")
            if _link_exists(c.veth(i)):
                _try_run(["ip", "link", "del", c.veth(i)], timeout=10)
        if _link_exists(c.bridge):
            p = _try_run(["ip", "link", "del", c.bridge], timeout=10)
            if p.returncode != 0:
                problems.append(f"ip link del {c.bridge}: {p.stderr.strip()}")
        with contextlib.suppress(OSError):
            (s / "cluster.json").unlink(missing_ok=True)
            c.env_file.unlink(missing_ok=True)
        entry = REGISTRY / f"{c.index}.json"
        with contextlib.suppress(OSError, ValueError):
            if json.loads(entry.read_text()).get("token") == c.token:
                entry.unlink()
    log(f"down in {time.monotonic() - t0:.1f}s" + (f"; problems: {problems}" if problems else ""))
    return problems


def registered() -> list[dict]:
    """Clusters registered on this machine: state folder, name, subnet, owner and whether it
    is still alive."""
    out = []
    for entry in sorted(REGISTRY.glob("*.json")) if REGISTRY.is_dir() else []:
        with contextlib.suppress(OSError, ValueError, TypeError):
            c = Cluster.from_json(json.loads(entry.read_text()))
            out.append({"state_dir": str(c.state_dir), "cluster": c.name, "nodes": c.nodes,
                        "subnet": f"{c.subnet}.0/24", "owner_pid": c.owner_pid,
                        "owner_alive": None if c.owner_pid is None else _alive(c.owner_pid),
                        "slurmctld_alive": _alive(c.pids.get("slurmctld", 0), "slurmctld")})
    return out


def reap_orphans(log: Log = _quiet) -> list[str]:
    """Tear down clusters on this machine whose owner process (a test session) is gone, or whose
    state folder was deleted. Returns the state folders reaped."""
    reaped = []
    for entry in sorted(REGISTRY.glob("*.json")) if REGISTRY.is_dir() else []:
        try:
            c = Cluster.from_json(json.loads(entry.read_text()))
        except (OSError, ValueError, TypeError):
            entry.unlink(missing_ok=True)
            continue
        owner_gone = c.owner_pid is not None and (
            not _alive(c.owner_pid) or _start_time(c.owner_pid) != c.owner_start)
        on_disk = Cluster.load(c.state_dir)
        replaced = on_disk is None or on_disk.token != c.token
        if owner_gone or replaced:
            log(f"reaping cluster {c.name} ({c.state_dir}): "
                + ("owner gone" if owner_gone else "state folder gone or reused"))
            _teardown(c, c.state_dir, grace=2.0, log=log)
            entry.unlink(missing_ok=True)
            reaped.append(str(c.state_dir))
    return reaped


def leftovers(c: Cluster) -> list[str]:
    """What of cluster `c` still exists (processes, namespaces, links); [] when fully down."""
    out = []
    for comm, pf in c.pid_files():
        pid = _read_pid(pf)
        if pid is not None and _alive(pid, comm):
            out.append(f"{comm} pid {pid}")
    existing = _existing_netns()
    for i in range(len(c.nodes)):
        if c.netns(i) in existing:
            out.append(f"netns {c.netns(i)}")
        if _link_exists(c.veth(i)):
            out.append(f"link {c.veth(i)}")
    if _link_exists(c.bridge):
        out.append(f"bridge {c.bridge}")
    return out


def status(state_dir: Path | str = DEFAULT_STATE_DIR) -> dict:
    """A description of the cluster in `state_dir`: daemons alive, namespaces, sinfo."""
    state_dir = Path(state_dir).absolute()
    c = Cluster.load(state_dir)
    if c is None:
        return {"state_dir": str(state_dir), "up": False, "reason": "no cluster.json"}
    daemons = {}
    for comm, pf in c.pid_files():
        pid = _read_pid(pf)
        key = f"{comm}:{pf.parent.name}" if comm == "slurmd" else comm
        daemons[key] = {"pid": pid, "alive": bool(pid and _alive(pid, comm))}
    existing = _existing_netns()
    env = {**os.environ, **c.env}
    try:
        sinfo = _run(["sinfo", "-h", "-N", "-o", "%N %T %c"], env=env, timeout=10, check=False)
    except (ClusterError, OSError) as e:
        sinfo = subprocess.CompletedProcess([], -1, "", str(e))
    info = {
        "state_dir": str(state_dir), "cluster": c.name, "subnet": f"{c.subnet}.0/24",
        "nodes": c.nodes, "partition": c.partition, "ports": c.ports, "env": c.env,
        "daemons": daemons,
        "namespaces": {c.netns(i): c.netns(i) in existing for i in range(len(c.nodes))},
        "bridge": _link_exists(c.bridge),
        "sinfo": sinfo.stdout.strip() if sinfo.returncode == 0 else sinfo.stderr.strip(),
    }
    info["up"] = all(d["alive"] for d in daemons.values()) and all(info["namespaces"].values())
    return info


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="bring up a fresh cluster (tears down an existing one)")
    p_up.add_argument("--nodes", type=int, default=2)
    p_up.add_argument("--cpus-per-node", type=int, default=4)
    p_up.add_argument("--partition", default=PARTITION)
    p_up.add_argument("--timeout", type=float, default=120)
    p_up.add_argument("--extra-conf", action="append", default=[],
                      help="a line appended to slurm.conf (repeatable)")
    p_down = sub.add_parser("down", help="stop everything; never fails on a half-up cluster")
    p_down.add_argument("--purge", action="store_true", help="also delete the state folder")
    sub.add_parser("status", help="print the cluster's state as JSON")
    sub.add_parser("reap", help="tear down clusters whose owning test session is gone")
    sub.add_parser("list", help="the clusters registered on this machine")
    for p in (p_up, p_down, sub.choices["status"]):
        p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    a = ap.parse_args(argv)
    log = lambda msg: print(f"[slurm_cluster] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    if a.cmd == "up":
        try:
            c = up(a.state_dir, nodes=a.nodes, cpus_per_node=a.cpus_per_node,
                   partition=a.partition, extra_conf=a.extra_conf, timeout=a.timeout, log=log)
        except ClusterError as e:
            print(f"[slurm_cluster] up failed: {e}", file=sys.stderr)
            return 1
        for k, v in c.env.items():
            print(f"export {k}={v}")
        log(f"env file: {c.env_file}  (source it, then sinfo / sbatch / sacct use this cluster)")
        return 0
    if a.cmd == "list":
        print(json.dumps(registered(), indent=2))
        return 0
    if a.cmd == "reap":
        for d in reap_orphans(log=log):
            print(d)
        return 0
    if a.cmd == "down":
        problems = down(a.state_dir, purge=a.purge, log=log)
        for p in problems:
            log(f"warning: {p}")
        return 0
    info = status(a.state_dir)
    print(json.dumps(info, indent=2))
    return 0 if info.get("up") else 3


if __name__ == "__main__":
    sys.exit(main())
