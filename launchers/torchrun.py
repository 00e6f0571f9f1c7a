"""cluster=torchrun: this process is one rank of a job that torchrun, a Kubernetes operator
(Kubeflow's PyTorchJob or TrainJob, JobSet) or SkyPilot started, and every process of the job runs
`python -m llama_fsdp cluster=torchrun ...` itself.

What the local and SLURM launchers do once, in the process that launches, happens once per job
here, inside the job, after the process group is up (``once_per_job``):

- the first rank of every node prepares that node: the model files (a hub name is downloaded
  into the node's cache) and the tokenized data in its cache. Tokenization is deterministic, so
  nodes without a shared filesystem build identical rows; with one, the cache's file lock lets
  one build and the others find it;
- global rank 0 does the job's part: reaches the tracking store, writes config.yaml, creates
  (or continues) the MLflow run, and owns the run directory to the end;
- every rank then agrees: a failure on any rank stops every rank with its message, before any
  model is built.

torchrun's ``--max-restarts`` restarts every process; a restarted attempt
(TORCHELASTIC_RESTART_COUNT > 0) resumes from the newest complete checkpoint, as
``cluster.max_restarts`` does for the other launchers. Checkpoints of a job on several nodes
need a filesystem every node shares (DCP writes each rank's shards where the rank runs).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..prepare.data import prepare_data
from ..prepare.job import prepare_job
from ..prepare.model import resolve_model
from ..config.placement import Placement
from ..config.status import FINISHED
from ..config.rundir import RUNS, name_problem
from ..run.spec import ConfigError
from .base import Launcher
from .environment import scoped_environ, worker_env
from .hosts import this_host
from .process import load_entry
from .proctitle import set_title

if TYPE_CHECKING:
    from ..run.spec import RunSpec

log = logging.getLogger(__name__)

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"


def restart_count() -> int:
    """How many times torchrun restarted this job's processes (0 for the first attempt)."""
    return int(os.environ.get(RESTART_ENV) or 0)


def job_run_id() -> Optional[str]:
    """torchrun's rendezvous id, the same in every process and every restart (None without
    one, as in a bare RANK / WORLD_SIZE launch)."""
    run_id = os.environ.get(RUN_ID_ENV)
    return run_id if run_id and run_id != "none" else None


def rank() -> int:
    return int(os.environ.get("RANK") or 0)


def once_per_job(env: Any, *, node: Callable[[], Any], job: Callable[[], Optional[str]]
                 ) -> Optional[str]:
    """Run ``node()`` on the first rank of every node but the first, and ``job()`` (the node's
    duties and the job's) on global rank 0 (collective: every rank calls it, with the process
    group up). A failure anywhere is raised on every rank with the first failing rank's message.
    ``job`` may return why there is nothing to train (a finished run); every rank returns it."""
    import torch.distributed as dist

    outcome: tuple[Optional[str], Optional[str]] = (None, None)
    try:
        if env.rank == 0:
            outcome = (None, job())
        elif env.local_rank == 0:
            node()
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, or they would wait
        outcome = (f"rank {env.rank}: {e}", None)
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    first = next((err for err, _ in outcomes if err), None)
    if first is not None:
        raise JobPreparationError(first)
    return outcomes[0][1]


class JobPreparationError(RuntimeError):
    """A rank could not prepare its node or the job; every rank stops with this message."""




TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_layout(cluster: Any, problems: list[str],
                    environ: Optional[dict] = None) -> tuple[int, int]:
    """cluster=torchrun: (nodes, ranks per node) from the environment torchrun or a Kubernetes
    operator gives each process (WORLD_SIZE, LOCAL_WORLD_SIZE: 1 when unset, as a bare
    RANK/WORLD_SIZE launch has one process per node; GROUP_WORLD_SIZE), checked against the
    config's values where it sets them."""
    e = os.environ if environ is None else environ
    missing = [v for v in TORCHRUN_VARS if not e.get(v)]
    if missing:
        problems.append(
            f"cluster=torchrun runs in a process started by torchrun or a Kubernetes operator, "
            f"but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set here: start "
            "it with `torchrun --nnodes=N --nproc_per_node=G --rdzv-backend=c10d "
            "--rdzv-endpoint=HOST:PORT -m llama_fsdp cluster=torchrun ...`, or use "
            "cluster=local on one host")
        return cluster.nodes or 1, cluster.nproc_per_node or 1
    world, nproc = int(e["WORLD_SIZE"]), int(e.get("LOCAL_WORLD_SIZE") or 1)
    nodes = int(e.get("GROUP_WORLD_SIZE") or max(world // max(nproc, 1), 1))
    if nodes * nproc != world:
        problems.append(f"the environment has WORLD_SIZE={world} processes, not a whole number "
                        f"of nodes of LOCAL_WORLD_SIZE={nproc}: give every node the same "
                        "--nproc_per_node")
    for key, ours, theirs in (("nodes", cluster.nodes, nodes),
                              ("nproc_per_node", cluster.nproc_per_node, nproc)):
        if ours is not None and ours != theirs:
            problems.append(f"cluster.{key}={ours} but the launcher started {theirs} (from "
                            f"WORLD_SIZE={world}, LOCAL_WORLD_SIZE={nproc}): drop cluster.{key} "
                            "(cluster=torchrun reads it from the environment) or launch "
                            f"{ours}")
    return nodes, nproc


HUB_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


class TorchrunLauncher(Launcher):
    """cluster=torchrun: this process is one rank of a job another launcher started (torchrun's
    agent is the controller and the supervisor); ``launch`` does the job's once-only duties
    inside the job, then runs the entry point here, in this process."""

    @property
    def waits(self) -> bool:
        return rank() == 0  # it sees the job end; the others go with it

    def placement(self, cfg: Any, output_dir: str) -> Placement:
        """This host's GPUs and RAM; the nodes and ranks per node that torchrun started."""
        problems: list[str] = []
        nodes, nproc = torchrun_layout(cfg.cluster, problems)
        return this_host(cfg, nodes=nodes, nproc=nproc, problems=problems)

    @property
    def speaks(self) -> bool:
        return rank() == 0

    def run_dir(self, output_dir: str, *, given: bool) -> str:
        """Every process of the job and every restart must agree on the run directory, and
        Hydra's is made per process at its start time: output_dir= as given, else
        outputs/runs/torchrun-<torchrun's run id>."""
        if given:
            return super().run_dir(output_dir, given=given)
        if (run_id := job_run_id()) is None:
            raise ConfigError(["cluster=torchrun without a torchrun run id (TORCHELASTIC_RUN_ID; "
                               "a launch by environment variables, as Kubernetes operators do "
                               "it, has none) needs a run directory every process and restart "
                               "agrees on: give torchrun --rdzv-id=<name> "
                               "(outputs/runs/torchrun-<name>) or output_dir=<dir>"])
        if (problem := name_problem("torchrun's run id (--rdzv-id)", run_id)) is not None:
            raise ConfigError([problem])
        return str((Path.cwd() / RUNS / f"torchrun-{run_id}").resolve())

    def preflight(self, spec: RunSpec) -> list[str]:
        if spec.sweep_id is not None:
            return ["sweeps (-m) do not run under cluster=torchrun, which starts the processes "
                    "of one run: start one torchrun job per point, or sweep with cluster=local "
                    "or cluster=slurm"]
        return []

    def preview(self, spec: RunSpec) -> str:
        return (f"this process as rank {rank()} of the {spec.world_size} that torchrun started "
                f"({spec.nodes} node(s) x {spec.nproc_per_node}), running {self.entry} (backend "
                f"{spec.backend}, device {spec.device})")

    def launch(self, spec: RunSpec, *, held: contextlib.ExitStack,
               command: str) -> Optional[list[Any]]:
        """The process group first; then every node's first rank prepares its node and global
        rank 0 the job (``once_per_job``); then this rank trains. This rank's result, or None
        when the job has nothing to train."""
        from ..train.distributed import process_group  # torch: this process is a rank

        if restart := restart_count():  # torchrun restarted the job: go on from the checkpoint
            spec = dataclasses.replace(spec, resume="auto", restart=restart)
        # what the other launchers export to their ranks, but the allocator's settings, which
        # act only from a process's start (torchrun's environment is the user's to give)
        exported = worker_env(spec.output_dir, spec.device, environ={})
        os.environ.update({k: v for k, v in exported.items()
                           if not k.startswith("MALLOC_") and k not in HUB_OFFLINE})
        entry = load_entry(self.entry)
        with process_group(spec) as (env, _device):
            if once_per_job(env, node=lambda: prepare_data(resolve_model(spec)),
                            job=lambda: self._prepare_job(spec, held, command)):
                return None
            with scoped_environ(HUB_OFFLINE):  # the node's first rank fetched what it needs
                spec = resolve_model(spec)
            os.environ.update(HUB_OFFLINE)  # from here on, as a launched rank: no hub
            set_title(env.rank, spec.world_size, "worker", spec.output_dir)
            return [entry(spec)]

    @staticmethod
    def _prepare_job(spec: RunSpec, held: contextlib.ExitStack, command: str) -> Optional[str]:
        """Global rank 0's part: why there is nothing to train, or None."""
        return FINISHED if prepare_job(spec, held=held, command=command) is None else None
