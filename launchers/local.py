"""cluster=local: submitit's local executor starts one rank supervisor per rank on this host."""
from __future__ import annotations

import logging
import os
import shlex
from typing import TYPE_CHECKING, Any, Callable, Optional

from .base import Launcher
from .environment import free_port, scoped_environ, worker_env
from .errors import RankFailure
from .signals import SignalGuard
from .watch import streaming, watch
from ..config.placement import Placement
from ..config.rundir import RunDir
from .forked import PRELOAD_ENV
from .hosts import this_host
from .rank import ATTEMPT_ENV, RUN_DIR_ENV, rank_entry

if TYPE_CHECKING:
    from ..run.spec import RunSpec

log = logging.getLogger(__name__)

NO_TIME_LIMIT_MIN = 60 * 24 * 365  # submitit needs a number; a local run has no job limit


def local_parameters(spec: RunSpec) -> dict[str, Any]:
    """What submitit's LocalExecutor is given for a RunSpec.

    On CUDA every rank sees the node's GPUs that this process sees (submitit would otherwise
    hide them: it sets CUDA_VISIBLE_DEVICES to its gpus_per_node first devices) and takes the
    one of its local rank.
    """
    c = spec.cluster
    params: dict[str, Any] = {
        "tasks_per_node": spec.nproc_per_node, "nodes": 1,
        "timeout_min": c.timeout_min if c.timeout_min is not None else NO_TIME_LIMIT_MIN,
        "signal_delay_s": c.signal_delay_s,
    }
    if spec.device == "cuda":
        params["gpus_per_node"] = spec.nproc_per_node
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            ids = [x.strip() for x in visible.split(",") if x.strip()]
            if all(x.isdigit() for x in ids):
                params["visible_gpus"] = tuple(int(x) for x in ids)
            else:  # UUIDs / MIG names: submitit takes integers only, so pass them on as they are
                params["setup"] = [f"export CUDA_VISIBLE_DEVICES={shlex.quote(visible)}"]
    return params


def _executor(spec: RunSpec, early: Any = None) -> Any:
    from .submitit_compat import SessionLocalExecutor

    executor = SessionLocalExecutor(folder=RunDir(spec.output_dir).submitit,
                                    max_num_timeout=spec.cluster.max_requeues, early=early)
    executor.update_parameters(**local_parameters(spec))
    return executor


class LocalLauncher(Launcher):
    """cluster=local: submitit's local executor starts the controller, which starts one rank
    supervisor per rank on this host; this process waits for them, and delivers rank 0's
    tracking spool meanwhile."""

    ships_tracking = True
    _early: Any = None  # the first attempt's controller, started before the job is prepared

    def placement(self, cfg: Any, output_dir: str) -> Placement:
        """This host: its GPUs (one rank each) or 2 CPU ranks, its RAM."""
        c, problems = cfg.cluster, []
        if c.nodes is None:
            problems.append("cluster.nodes=null with cluster=local: set a number of nodes")
        elif c.nodes != 1:
            problems.append(
                f"cluster.nodes={c.nodes} with cluster=local: a local run uses this host only; "
                "use cluster=slurm for several nodes, or sharding.shard_size to emulate them")
        return this_host(cfg, nodes=c.nodes or 1, nproc=None, problems=problems)

    def preview(self, spec: RunSpec) -> str:
        return (f"{spec.nproc_per_node} local rank process(es) via submitit's local executor, "
                f"each running {self.entry} (backend {spec.backend}, device {spec.device})")

    def ranks_env(self, spec: RunSpec) -> dict[str, str]:
        """What the controller and the ranks get on top of this process's environment (this
        process's own is restored after the launch)."""
        return {**worker_env(spec.output_dir, spec.device), RUN_DIR_ENV: spec.output_dir,
                # on the CPU the controller imports the ranks' module once and forks them
                PRELOAD_ENV: self.entry.split(":")[0] if spec.device == "cpu" else "",
                ATTEMPT_ENV: "0"}

    def launch(self, spec: RunSpec, *, held: Any, command: str) -> Optional[list[Any]]:
        """As every launcher's, with the job's controller started first on the CPU: it imports
        the ranks' modules (about 5 s of one core) while this process prepares the job."""
        from .submitit_compat import EarlyController

        if spec.device == "cpu" and self.entry:
            self._early = EarlyController(RunDir(spec.output_dir).submitit,
                                          {**os.environ, **self.ranks_env(spec)})
        try:
            return super().launch(spec, held=held, command=command)
        finally:
            early, self._early = self._early, None
            if early is not None:
                early.cancel()

    def start(self, spec: RunSpec, *, stream: bool = True,
              on_submitted: Optional[Callable[[str, bool], None]] = None) -> list[Any]:
        """Run the entry point on spec.nproc_per_node local ranks; return each rank's result.

        A rank that dies stops every rank; with cluster.max_restarts the run then restarts from
        its newest complete checkpoint, in the same MLflow run.
        """
        executor = _executor(spec, early=self._early)
        restarts = spec.cluster.max_restarts
        with scoped_environ(self.ranks_env(spec)), self.shipping(spec) as ranks_spec, \
                SignalGuard(saving=spec.save.every_steps > 0) as guard:
            for attempt in range(restarts + 1):
                os.environ[ATTEMPT_ENV] = str(attempt)
                job = executor.submit(rank_entry(ranks_spec, self.entry, master_addr="127.0.0.1",
                                                 master_port=free_port()))
                guard.job = job
                log.info("started %d local rank(s) (job %s%s); logs in %s", spec.nproc_per_node,
                         job.job_id, f", restart {attempt} of {restarts}" if attempt else "",
                         executor.folder)
                try:
                    with streaming(job, stream):
                        return watch(job, spec.output_dir)
                except RankFailure as failure:
                    if attempt == restarts:
                        raise
                    log.warning("%s\nrestarting every rank from the newest checkpoint (restart "
                                "%d of %d)", failure, attempt + 1, restarts)
        raise AssertionError("unreachable")
