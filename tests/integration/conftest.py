"""Integration fixtures: a real SLURM cluster on this machine (see scripts/slurm_cluster.py).

Fixture ``slurm_cluster`` (session scope) -> :class:`SlurmCluster`
----------------------------------------------------------------------
A 2-node Slurm 22.05 cluster: ``slurmctld`` + ``slurmdbd`` (real accounting, private MariaDB)
in the root namespace, ``slurmd`` for ``node1`` and ``node2`` each in its own network namespace
with its own hostname, on a private bridge ``10.77.K.0/24``. Nodes advertise 4 CPUs each
(oversubscribing the host: they all share its cores) and the host's memory; partition
``debug`` is the default; ``preemptible`` (``GraceTime`` ``PREEMPT_GRACE_S``) and ``urgent``
(a higher ``PriorityTier``) hold the same nodes, and a job in ``urgent`` preempts one in
``preemptible`` or ``debug`` (``PreemptType=preempt/partition_prio``, ``PreemptMode=REQUEUE``: the
job is sent SIGTERM, killed after its grace time and ``KillWait`` (5 s), and requeued).
Brought up once per test session (about 3 s) and ALWAYS torn down at
the end: pytest finalizer, ``atexit``, SIGTERM, and -- should the session be SIGKILLed -- the
next ``up`` on this machine reaps it (the cluster records the session's pid as its owner).

While the fixture is active, ``cluster.env`` is applied to ``os.environ`` (and restored at
teardown), so sbatch / squeue / sacct and submitit in the test process talk to this cluster;
jobs inherit the submitter's environment (sbatch exports it), which is how they find the
repository (``PYTHONPATH``) and ``SLURM_CONF``.

Attributes
    ``env``            ``{"SLURM_CONF": <state>/slurm.conf, "PYTHONPATH": "<repo>[:...]"}``
    ``partition``      ``"debug"``
    ``nodes``          ``["node1", "node2"]`` (also the hostnames that jobs see)
    ``cpus_per_node``  4
    ``state_dir``      Path: slurm.conf, ``ctld/slurmctld.log``, ``nodes/<node>/slurmd.log``,
                       ``dbd/slurmdbd.log``, ``munge/``, ``db/``
    ``info``           the ``scripts.slurm_cluster.Cluster`` description (name, ports, subnet…)

Methods
    ``activate()``  context manager applying ``env`` to os.environ for a block (the session
        fixture keeps its own cluster activated throughout; factory clusters need it).
    ``submitit_folder(tmp) -> Path``  ``tmp/submitit-<cluster token>/%j``: a folder no other
        cluster start used, one sub-folder per job (a stale result file from an earlier cluster
        must never be picked up). Pass it to ``submitit.AutoExecutor(folder=..., cluster="slurm")``.
    ``executor(folder, **params) -> submitit.AutoExecutor``  ``cluster="slurm"`` with
        ``slurm_partition=<partition>``, ``timeout_min=10``, ``nodes=1``, ``tasks_per_node=1``,
        ``cpus_per_task=1`` as defaults; ``params`` override them (any AutoExecutor parameter).
    ``wait(job, timeout=120) -> job``  waits until submitit sees the job (or every task of a
        multi-task job) done: result file written or ``sacct`` shows a final state. On timeout
        it cancels the job and raises ``TimeoutError`` with the job's logs and the daemons' log
        tails. Use it before ``job.result()`` / ``job.results()`` / ``job.exception()``, which
        themselves wait without a deadline.
    ``sacct(job_id) -> list[dict]``  rows of ``sacct -j ID`` (JobID, State, ExitCode, NodeList,
        ...), straight from accounting.
    ``logs(lines=30) -> str``  tails of the daemon logs, for assertion messages.

While the fixture is active, submitit's per-task grace for a missing result file
(``submitit.core.core.Job._results_timeout_s``, 15 s, meant for slow NFS) is set to 0:
the folders are on local disk, and a crashed 2x2 job is then reported in seconds, not a minute.

Fixture ``slurm_cluster_factory`` (function scope) -> ``make(nodes=1, cpus_per_node=4,
partition="debug", extra_conf=()) -> SlurmCluster``
----------------------------------------------------------------------
Extra clusters for tests that need their own ``slurm.conf`` lines (``extra_conf`` is appended:
preemption settings, more partitions, ...), each in its own state folder and subnet, torn down
at the end of the test (with the same guarantees). Their env is NOT applied: submit and wait
inside ``with cluster.activate(): ...``. Job ids start at a random number on every cluster
start, so ids never collide with the session cluster's (submitit caches job states by id).

Module helpers: ``require_slurm()`` (skip, or fail under LLAMA_FSDP_REQUIRE_SLURM=1, when no
cluster can run here), ``slurm_problems()`` (the reasons; [] when a cluster can run),
``REPO_ROOT``, and ``slurm_cluster_mod`` (the imported scripts/slurm_cluster.py: ``up``,
``down``, ``status``, ``leftovers`` for tests that need their own cluster -- give each its own
state folder).

Skipping: without root or without the Slurm / munge / MariaDB binaries (``.ci/slurm_deps.sh``
installs them) tests using the fixture are skipped with the reason; with
``LLAMA_FSDP_REQUIRE_SLURM=1`` (CI) they fail instead.

Every test in tests/integration/ is marked ``integration`` automatically.

Notes for job code: pass ``cluster="slurm"`` explicitly (an installed ``srun`` makes
``AutoExecutor`` pick Slurm even without a cluster). Inside a job,
``submitit.helpers.TorchDistributedEnvironment().export()`` sets MASTER_ADDR (= the first
node's hostname, resolvable in every node namespace), MASTER_PORT, RANK, WORLD_SIZE,
LOCAL_RANK; it raises if one of them is already set -- jobs inherit the submitter's
environment, so do not submit from a process that has them set (or pass ``overwrite=True``).
Give ``init_process_group`` a timeout: a missing peer otherwise hangs. A task that exits
non-zero does not stop its siblings (Slurm's default ``KillOnBadExit=0``); they end on their
own timeouts unless the job asks for ``slurm_srun_args=["--kill-on-bad-exit=1"]``.
The first job after a cluster starts may wait 1-3 s for Slurm's first scheduling pass.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
REQUIRE_ENV = "LLAMA_FSDP_REQUIRE_SLURM"
UP_TIMEOUT_S = 180          # a shared 2-core machine can be slow
NODES = 2
CPUS_PER_NODE = 4
PREEMPT_GRACE_S = 30  # GraceTime of partition preemptible
# preemption by partition priority: a job in "urgent" preempts one in "debug" or "preemptible"
PREEMPTION_CONF = (
    "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
    f"PartitionName=preemptible Nodes=node[1-{NODES}] GraceTime={PREEMPT_GRACE_S} "
    "MaxTime=INFINITE State=UP",
    f"PartitionName=urgent Nodes=node[1-{NODES}] PriorityTier=2 MaxTime=INFINITE State=UP")
# submitit waits `Job._results_timeout_s` (15 s) per task for a result file that a crashed job
# never writes (a grace for slow NFS). The cluster's folders are on local disk and a task writes
# its result before it exits, so the fixture sets it to 0 while the session runs: a crashed 2x2
# job is reported in seconds instead of ~75 s.
RESULTS_TIMEOUT_S = 0


def _load_cluster_module():
    path = REPO_ROOT / "scripts" / "slurm_cluster.py"
    spec = importlib.util.spec_from_file_location("llama_fsdp_slurm_cluster", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses need the module registered
    spec.loader.exec_module(mod)
    return mod


slurm_cluster_mod = _load_cluster_module()


def slurm_problems() -> list[str]:
    return slurm_cluster_mod.missing_requirements()


def require_slurm() -> None:
    """Skip the calling test (fail it under LLAMA_FSDP_REQUIRE_SLURM=1) when no cluster can run
    here. The fixture calls it; tests that start their own cluster call it first."""
    problems = slurm_problems()
    if problems:
        _skip_or_fail("; ".join(problems))


def _skip_or_fail(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but no SLURM cluster can run here: {reason}", pytrace=False)
    pytest.skip(f"no local SLURM cluster: {reason}")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


PASSED: set[str] = set()  # "<file>::<function>" of every test that passed in this process


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and report.passed:
        PASSED.add(f"{Path(str(item.fspath)).relative_to(REPO_ROOT)}::{item.originalname}")


@pytest.fixture(scope="session", autouse=True)
def _docs_commands_ran():
    """Every docs command whose REGISTRY entry names a test that passed here was executed
    (built by docs.command(id), run by docs.run / docs.start): an entry cannot point at a test
    that runs something else. Checked when the session ends (a module's tests share one
    process under `--dist loadscope`; their shared runs happen in fixtures)."""
    yield
    from tests import docs_commands as docs

    missing = sorted(f"{e.id} ({e.test})" for e in docs.REGISTRY.values()
                     if e.test in PASSED and e.id not in docs.RAN)
    assert not missing, ("docs commands whose test passed without running them: "
                         + ", ".join(missing))


class SlurmCluster:
    """A running cluster, as handed to tests by the ``slurm_cluster`` fixture."""

    def __init__(self, info: Any):
        self.info = info
        self.state_dir: Path = info.state_dir
        self.partition: str = info.partition
        self.nodes: list[str] = list(info.nodes)
        self.cpus_per_node: int = info.cpus_per_node
        pythonpath = os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.env: dict[str, str] = {**info.env, "PYTHONPATH": pythonpath}

    @contextlib.contextmanager
    def activate(self):
        """Apply ``env`` to os.environ for the block (restored after): sbatch / sacct and
        submitit in this process then talk to this cluster."""
        from llama_fsdp.launchers.environment import scoped_environ

        with scoped_environ(self.env):
            yield self

    # ---- submitit helpers -------------------------------------------------------------------
    def submitit_folder(self, tmp: os.PathLike | str) -> Path:
        return Path(tmp) / f"submitit-{self.info.token}" / "%j"

    def executor(self, folder: os.PathLike | str, **params: Any):
        import submitit

        ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
        defaults = dict(slurm_partition=self.partition, timeout_min=10, nodes=1,
                        tasks_per_node=1, cpus_per_task=1)
        ex.update_parameters(**{**defaults, **params})
        return ex

    def wait(self, job: Any, timeout: float = 120, poll: float = 0.25):
        deadline = time.monotonic() + timeout
        while True:
            try:
                if job.done():
                    return job
            except Exception:  # noqa: BLE001 - a transient sacct hiccup; the deadline decides
                pass
            if time.monotonic() > deadline:
                with contextlib.suppress(Exception):
                    job.cancel(check=False)
                raise TimeoutError(
                    f"job {job.job_id} not done after {timeout:.0f}s\n"
                    f"sacct: {self.sacct(job.job_id)}\n"
                    f"stdout:\n{_tail_text(job.stdout())}\nstderr:\n{_tail_text(job.stderr())}\n"
                    + self.logs())
            time.sleep(poll)

    # ---- inspection ----------------------------------------------------------------------
    def sacct(self, job_id: str | int) -> list[dict[str, str]]:
        fields = "JobID,JobName,State,ExitCode,NodeList,Partition,Elapsed"
        p = subprocess.run(["sacct", "-j", str(job_id), "-o", fields, "--parsable2"],
                           capture_output=True, text=True, timeout=30,
                           env={**os.environ, **self.env})
        lines = p.stdout.splitlines()
        if p.returncode != 0 or not lines:
            return [{"error": (p.stderr or p.stdout).strip()}]
        names = lines[0].split("|")
        return [dict(zip(names, line.split("|"))) for line in lines[1:]]

    def logs(self, lines: int = 30) -> str:
        s = self.state_dir
        files = [s / "ctld" / "slurmctld.log", s / "dbd" / "slurmdbd.log"]
        files += [s / "nodes" / n / "slurmd.log" for n in self.nodes]
        return "\n".join(slurm_cluster_mod._tail(f, lines) for f in files)

    def __repr__(self) -> str:
        return (f"SlurmCluster({self.info.name}, nodes={self.nodes}, partition={self.partition!r}, "
                f"state_dir={str(self.state_dir)!r})")


def _tail_text(text: str | None, lines: int = 40) -> str:
    if not text:
        return "(none)"
    return "\n".join(text.splitlines()[-lines:])


def _log(msg: str) -> None:
    print(f"[slurm_cluster] {msg}", file=sys.stderr, flush=True)


def _state_dir(tmp_path_factory, name: str = "slurm") -> Path:
    d = tmp_path_factory.mktemp(name)
    if len(str(d)) > 60:                  # unix socket paths live under it
        d = Path(tempfile.mkdtemp(prefix="lfslurm-", dir="/tmp"))
    return d


# ---- teardown that always happens: finalizer, atexit, SIGTERM ---------------------------------
_pending: dict[str, Path] = {}           # state folders of clusters this process started
_sigterm_installed = False


def _teardown(state_dir: Path) -> list[str]:
    if _pending.pop(str(state_dir), None) is None:
        return []
    return slurm_cluster_mod.down(state_dir)


def _teardown_all() -> None:
    for d in list(_pending.values()):
        with contextlib.suppress(Exception):
            _teardown(d)


def _on_sigterm(signum, frame):          # a cancelled CI job still takes its clusters down
    _teardown_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _forget_clusters_in_child() -> None:
    _pending.clear()
    with contextlib.suppress(ValueError):
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _install_cleanup_hooks() -> None:
    global _sigterm_installed
    if _sigterm_installed:
        return
    _sigterm_installed = True
    atexit.register(_teardown_all)
    # a process forked from this one (a datasets or multiprocessing worker) must never take
    # this process's clusters down: it forgets them and its SIGTERM is the default again
    os.register_at_fork(after_in_child=_forget_clusters_in_child)
    with contextlib.suppress(ValueError):          # not in the main thread: atexit only
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _on_sigterm)


def _start(state_dir: Path, nodes: int, cpus_per_node: int, partition: str,
           extra_conf: tuple[str, ...]) -> SlurmCluster:
    _install_cleanup_hooks()
    _pending[str(state_dir)] = state_dir
    try:
        info = slurm_cluster_mod.up(state_dir, nodes=nodes, cpus_per_node=cpus_per_node,
                                    partition=partition, extra_conf=extra_conf,
                                    timeout=UP_TIMEOUT_S, owner_pid=os.getpid(), log=_log)
    except slurm_cluster_mod.ClusterError as e:
        _teardown(state_dir)
        pytest.fail(f"could not bring up a SLURM cluster: {e}", pytrace=False)
    return SlurmCluster(info)


def _stop(cluster: SlurmCluster) -> None:
    problems = _teardown(cluster.state_dir)
    left = slurm_cluster_mod.leftovers(cluster.info)
    if problems or left:
        raise RuntimeError(f"SLURM cluster teardown incomplete: {problems} {left}")


@contextlib.contextmanager
def _fast_missing_results():
    import submitit.core.core as submitit_core

    saved = submitit_core.Job._results_timeout_s
    submitit_core.Job._results_timeout_s = RESULTS_TIMEOUT_S
    try:
        yield
    finally:
        submitit_core.Job._results_timeout_s = saved


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    require_slurm()
    cluster = _start(_state_dir(tmp_path_factory), NODES, CPUS_PER_NODE,
                     slurm_cluster_mod.PARTITION, PREEMPTION_CONF)
    try:
        with cluster.activate(), _fast_missing_results():
            yield cluster
    finally:
        _stop(cluster)


@pytest.fixture
def slurm_cluster_factory(tmp_path_factory):
    """``make(nodes=1, cpus_per_node=4, partition="debug", extra_conf=()) -> SlurmCluster``:
    extra clusters with their own slurm.conf lines (preemption, partitions, ...), torn down at
    the end of the test. Their env is NOT applied: submit inside ``with cluster.activate():``."""
    require_slurm()
    started: list[SlurmCluster] = []

    def make(nodes: int = 1, cpus_per_node: int = CPUS_PER_NODE,
             partition: str = slurm_cluster_mod.PARTITION,
             extra_conf: tuple[str, ...] | list[str] = ()) -> SlurmCluster:
        c = _start(_state_dir(tmp_path_factory, "slurm_extra"), nodes, cpus_per_node, partition,
                   tuple(extra_conf))
        started.append(c)
        return c

    try:
        with _fast_missing_results():
            yield make
    finally:
        errors = []
        for c in reversed(started):
            try:
                _stop(c)
            except RuntimeError as e:
                errors.append(str(e))
        if errors:
            raise RuntimeError("; ".join(errors))
