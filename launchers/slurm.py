"""cluster=slurm through submitit: one rank supervisor per task, nodes x tasks_per_node."""
from __future__ import annotations

import logging
import re
import shutil
import subprocess
import shlex
from typing import TYPE_CHECKING, Any, Callable, Optional

from .base import Launcher
from .environment import worker_env
from .errors import LaunchError
from .signals import SignalGuard
from .slurm_state import DEFAULT_KILL_WAIT_S, PartitionFacts, job_state, partition_facts
from .watch import Requeues, streaming, watch
from ..config.placement import Placement
from ..config.rundir import RunDir
from ..run.checks import has_line_break, line_break
from .rank import ATTEMPT_ENV, rank_entry
from .submitit_compat import restarting_slurm_executor, sbatch_text

if TYPE_CHECKING:
    from ..run.spec import RunSpec

log = logging.getLogger(__name__)


def executor_parameters(spec: RunSpec) -> dict[str, Any]:
    """submitit SlurmExecutor parameters for a RunSpec (only the options that are set)."""
    c = spec.cluster
    params: dict[str, Any] = {
        "nodes": spec.nodes,
        "ntasks_per_node": spec.nproc_per_node,
        "time": c.timeout_min,
        "signal_delay_s": c.signal_delay_s,
        # (a sweep point's name holds its values: any blank or line break becomes _)
        "job_name": re.sub(r"\s+", "_", spec.run_name)[:64],
        # One failing rank ends the job step at once instead of leaving its peers in a
        # collective; appending keeps the logs of earlier restarts.
        "srun_args": ["--kill-on-bad-exit=1", "--open-mode=append", *c.srun_args],
        # ours first, so that the user's own setup lines (an allocator, say) have the last word
        "setup": [*(f"export {k}={shlex.quote(v)}"
                    for k, v in worker_env(spec.output_dir, spec.device).items()), *c.setup],
    }
    optional = {"partition": c.partition, "account": c.account, "qos": c.qos,
                "constraint": c.constraint, "cpus_per_task": c.cpus_per_task,
                "mem": f"{c.mem_gb}GB" if c.mem_gb is not None else None}
    params.update({k: v for k, v in optional.items() if v is not None})
    if spec.device == "cuda" and c.gpus_per_node:
        params["gpus_per_node"] = c.gpus_per_node
    if c.sbatch_extra:
        params["additional_parameters"] = dict(c.sbatch_extra)
    return params


def with_restarts(script: str, max_restarts: int) -> str:
    """The batch script's srun line in a loop: a failed job step (any rank died; srun's
    --kill-on-bad-exit stopped the others) runs again, up to max_restarts times, and the ranks
    resume from the newest checkpoint (they see LLAMA_FSDP_ATTEMPT > 0)."""
    lines = script.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    loop = [f"for attempt in $(seq 0 {max_restarts}); do",
            f"  export {ATTEMPT_ENV}=$attempt",
            f"  {lines[at]} && exit 0",
            "  echo \"llama_fsdp: job step failed (attempt $attempt of "
            f"{max_restarts} restarts)\" >&2",
            "done",
            "exit 1"]
    return "\n".join([*lines[:at], *loop, *lines[at + 1:]]) + "\n"


def node_ram(mem_gb: Optional[int], facts: Optional[PartitionFacts]
             ) -> tuple[Optional[int], str, str]:
    """(one node's RAM for the job, where that number comes from, how to get more):
    cluster.mem_gb, else the partition's smallest node as SLURM reports it (sinfo), else not
    known (SLURM does not answer where the plan is made)."""
    if mem_gb:
        return int(mem_gb * 10**9), "cluster.mem_gb", "a larger cluster.mem_gb, if the nodes have it"
    if facts is not None and facts.node_memory_mb:
        return (facts.node_memory_mb * 2**20,
                f"partition {facts.name}'s nodes, sinfo",
                "nodes with more memory (cluster.partition, cluster.constraint)")
    return None, "cluster.mem_gb unset, and SLURM does not answer here", \
        "cluster.mem_gb, to ask SLURM for what the run needs"


def make_executor(spec: RunSpec, *, preview: bool = False) -> Any:
    """The run's SLURM executor; ``preview``: one that only writes the script (no SLURM needed)."""
    cls = restarting_slurm_executor(spec.cluster.max_restarts, with_restarts, preview=preview)
    executor = cls(folder=RunDir(spec.output_dir).submitit / "%j",
                   max_num_timeout=spec.cluster.max_requeues)
    executor.update_parameters(**executor_parameters(spec))
    return executor


def sbatch_preview(spec: RunSpec) -> str:
    """The sbatch script this run would submit (what make_executor writes), on any machine:
    a dry run plans on a laptop for the cluster."""
    from .submitit_compat import sbatch_text

    return sbatch_text(make_executor(spec, preview=True))


class SlurmLauncher(Launcher):
    """cluster=slurm: submitit's SLURM executor submits one job of nodes x tasks_per_node
    tasks; srun starts one rank supervisor per task. This process waits for the job when
    cluster.wait (and streams rank 0's log), else returns at submission."""

    @property
    def waits(self) -> bool:
        return bool(self.cluster.wait)

    def sweep_note(self, points: int) -> Optional[str]:
        if self.waits:
            return (f"running {points} sweep points as SLURM jobs, one after another "
                    "(cluster.wait=true waits for each)")
        return (f"submitting {points} sweep points as SLURM jobs, all at once; the sweep returns "
                "once they are queued")

    def placement(self, cfg: Any, output_dir: str) -> Placement:
        """The job's nodes as the config asks for them (cluster.gpus_per_node, cluster.mem_gb),
        wherever the plan is made: the jobs wait in SLURM's queue. Where SLURM answers, the
        partition's nodes' memory stands in for an unset cluster.mem_gb, and its GraceTime and
        KillWait say how long the ranks have after SLURM's SIGTERM."""
        c, problems = cfg.cluster, []
        if c.nodes is None:
            problems.append("cluster.nodes=null with cluster=slurm: set a number of nodes")
        device = c.device if c.device != "auto" else ("cuda" if c.gpus_per_node > 0 else "cpu")
        nproc = c.nproc_per_node if c.nproc_per_node is not None else (
            c.gpus_per_node if device == "cuda" else 2)
        if device == "cuda" and c.gpus_per_node and nproc > c.gpus_per_node:
            problems.append(f"cluster.nproc_per_node={nproc} exceeds cluster.gpus_per_node="
                            f"{c.gpus_per_node}")
        if c.timeout_min is None:
            problems.append("cluster.timeout_min is required with cluster=slurm (the job's "
                            "--time, in minutes): set cluster.timeout_min=<minutes>")
        if has_line_break(str(output_dir)):  # in the #SBATCH lines
            problems.append(line_break("output_dir", str(output_dir)))
        facts = partition_facts(c.partition)
        ram, source, more = node_ram(c.mem_gb, facts)
        return Placement(
            device=device, nodes=c.nodes or 1, nproc_per_node=nproc, on_this_host=False,
            gpus_per_node=c.gpus_per_node, ram_bytes=ram, ram_source=source, more_ram=more,
            queued=True, problems=tuple(problems),
            stop_warning_s=facts.stop_warning_s if facts else DEFAULT_KILL_WAIT_S)

    def preflight(self, spec: RunSpec) -> list[str]:
        """sbatch on PATH, and a SLURM controller that answers."""
        if shutil.which("sbatch") is None:
            return ["cluster=slurm but sbatch is not on PATH: this is not a SLURM login node. Run "
                    "from one, use cluster=local, or add dry_run=true to see the job script"]
        # SLURM's commands are here: does its controller answer? (sinfo reads the same config
        # and asks the same slurmctld as sbatch)
        try:
            out = subprocess.run(["sinfo", "--noheader", "--format=%P"], capture_output=True,
                                 text=True, timeout=30)
            problem = (None if out.returncode == 0
                       else (out.stderr.strip().splitlines() or ["?"])[-1])
        except (OSError, subprocess.TimeoutExpired) as e:
            problem = f"sinfo did not answer: {e}"
        if problem:
            return [f"cluster=slurm but the SLURM controller does not answer here ({problem}). "
                    "Run from a login node of the cluster (or set SLURM_CONF), use "
                    "cluster=local, or add dry_run=true to see the job script"]
        return []

    def preview(self, spec: RunSpec) -> str:
        """The sbatch script this run would submit (what make_executor writes), on any
        machine: a dry run plans on a laptop for the cluster."""
        return sbatch_text(make_executor(spec, preview=True))

    def start(self, spec: RunSpec, *, stream: bool = True,
              on_submitted: Optional[Callable[[str, bool], None]] = None) -> list[Any]:
        """Submit; print job id and log paths; wait (streaming rank 0) only if cluster.wait
        (else no results: []). ``on_submitted(job_id, detached)`` is told the job id once SLURM
        has it."""
        executor = make_executor(spec)
        try:
            job = executor.submit(rank_entry(spec, self.entry, watched=self.waits))
        except Exception as e:  # sbatch's own message: invalid partition, account, qos, limits
            msg = re.sub(r"\s+", " ", str(e)).strip()
            raise LaunchError(f"SLURM refused the job: {msg}") from e
        if on_submitted is not None:
            on_submitted(str(job.job_id), not spec.cluster.wait)
        paths = job.paths
        log.info("submitted SLURM job %s: %d node(s) x %d task(s)\n  rank 0 log: %s\n  rank 0 "
                 "err: %s", job.job_id, spec.nodes, spec.nproc_per_node, paths.stdout,
                 paths.stderr)
        if not spec.cluster.wait:
            return []
        with SignalGuard(saving=spec.save.every_steps > 0) as guard:
            guard.job = job
            with streaming(job, stream):
                # SLURM's accounting is asked each poll: not more often than every 2 s
                job_id = str(job.job_id)
                return watch(job, spec.output_dir, max_restarts=spec.cluster.max_restarts,
                             restarts_inside=True, poll_s=2.0,
                             requeues=Requeues(job_id, lambda: job_state(job_id)))
