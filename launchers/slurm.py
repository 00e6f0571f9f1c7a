"""SLURM launch through submitit: one task per rank, nodes x tasks_per_node."""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from .common import Entry, LaunchError, RankEntry, clear_stale_errors, watch, worker_env

log = logging.getLogger(__name__)


def executor_parameters(spec: Any) -> dict[str, Any]:
    """submitit AutoExecutor parameters for a RunSpec (only the options that are set)."""
    c = spec.cluster
    params: dict[str, Any] = {
        "nodes": spec.nodes,
        "tasks_per_node": spec.nproc_per_node,
        "timeout_min": c.time_min,
        "slurm_job_name": spec.run_name[:64],
        # One failing rank ends the job step at once instead of leaving its peers in a collective.
        "slurm_srun_args": ["--kill-on-bad-exit=1", *c.srun_args],
        "slurm_setup": [*c.setup, *(f"export {k}={v}" for k, v in worker_env().items())],
    }
    optional = {"slurm_partition": c.partition, "slurm_account": c.account, "slurm_qos": c.qos,
                "slurm_constraint": c.constraint, "mem_gb": c.mem_gb,
                "cpus_per_task": c.cpus_per_task}
    params.update({k: v for k, v in optional.items() if v is not None})
    if spec.device == "cuda" and c.gpus_per_node:
        params["gpus_per_node"] = c.gpus_per_node
    if c.sbatch_extra:
        params["slurm_additional_parameters"] = dict(c.sbatch_extra)
    return params


def make_executor(spec: Any) -> Any:
    import submitit

    folder = Path(spec.output_dir) / "submitit" / "%j"
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    executor.update_parameters(**executor_parameters(spec))
    return executor


def sbatch_preview(spec: Any) -> str:
    """The sbatch script submitit would write, and the command every rank runs."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = executor_parameters(spec)
    renamed = {"nodes": "nodes", "tasks_per_node": "ntasks_per_node", "timeout_min": "time",
               "slurm_job_name": "job_name", "slurm_srun_args": "srun_args",
               "slurm_setup": "setup", "slurm_partition": "partition",
               "slurm_account": "account", "slurm_qos": "qos", "slurm_constraint": "constraint",
               "mem_gb": "mem", "cpus_per_task": "cpus_per_task",
               "gpus_per_node": "gpus_per_node",
               "slurm_additional_parameters": "additional_parameters"}
    kwargs = {renamed[k]: v for k, v in params.items()}
    if "mem" in kwargs:
        kwargs["mem"] = f"{kwargs['mem']}GB"
    command = f"{sys.executable} -u -m submitit.core._submit {Path(spec.output_dir) / 'submitit' / '%j'}"
    return _make_sbatch_string(command=command, folder=Path(spec.output_dir) / "submitit" / "%j",
                               **kwargs)


def launch_slurm(spec: Any, entry: Entry, *, stream: bool = True) -> Any:
    """Submit; print job id and log paths; wait (streaming rank 0) only if cluster.wait."""
    clear_stale_errors(spec.output_dir)
    executor = make_executor(spec)
    try:
        job = executor.submit(RankEntry(entry), spec)
    except Exception as e:  # sbatch's own message: invalid partition, account, qos, limits
        raise LaunchError(f"SLURM refused the job: {e}".strip()) from e
    paths = job.paths
    log.info("submitted SLURM job %s: %d node(s) x %d task(s)\n  rank 0 log: %s\n  rank 0 err: %s"
             "\n  MLflow: experiment '%s' at %s, run '%s'", job.job_id, spec.nodes,
             spec.nproc_per_node, paths.stdout, paths.stderr, spec.tracking.experiment,
             spec.tracking_uri, spec.run_name)
    if not spec.cluster.wait:
        return job
    return watch(job, spec.output_dir, stream=stream)
