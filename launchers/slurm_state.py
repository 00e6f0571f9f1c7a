"""What SLURM says now about a job and a partition (scontrol, sinfo): whether a job was requeued
or is being preempted, and what a partition's nodes have and how long SLURM lets a job stop.

A requeued job (a preemption, an admin's ``scontrol requeue``, a failed node with ``--requeue``)
is still the same job: its ranks are killed, and it waits in the queue and runs again from the
newest checkpoint. It never failed, and cancelling it would lose it; ``JobState.requeued`` is
what the launcher's watch and rank 0's supervisor ask before they call a job failed.

SLURM's signals before it stops a job: ``SIGTERM`` to every process of the job, then ``SIGKILL``
after ``KillWait`` (a cancel, a requeue, a time limit); a preemption sends the first SIGTERM as
it selects the job, and the kill sequence follows after the partition's ``GraceTime`` (with
``PreemptParameters=send_user_signal`` the first signal is the job's ``--signal`` instead).
A job whose ranks end inside its grace time is over (COMPLETED), not requeued: rank 0 requeues
it itself (launchers/rank.py).
"""
from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)

ASK_TIMEOUT_S = 10.0  # how long a running job's state may take to come back
PLAN_TIMEOUT_S = 5.0  # the partition's facts, when a plan is made: not known past this
# A job SLURM is taking back into its queue (its restart count says so too)
REQUEUE_STATES = frozenset({"REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})
DEFAULT_KILL_WAIT_S = 30  # slurm.conf's KillWait when not set


@dataclass(frozen=True)
class JobState:
    """One job as ``scontrol show job`` says it now."""

    state: str  # JobState: RUNNING, PENDING, COMPLETING, ...
    restarts: int  # how many times SLURM has requeued it (SLURM_RESTART_COUNT of its next run)
    preempting: bool  # selected for preemption (PreemptTime set): its grace time runs
    reason: str = ""

    def requeued(self, requeue: int) -> bool:
        """Whether SLURM requeued the job since its run number ``requeue`` (the
        SLURM_RESTART_COUNT that run saw), or holds it in its queue again."""
        return self.restarts > requeue or self.state in REQUEUE_STATES


def _field(text: str, key: str) -> Optional[str]:
    """A ``Key=value`` of scontrol's one-line output (values without blanks)."""
    m = re.search(rf"(?:^|\s){re.escape(key)}=(\S*)", text)
    return m.group(1) if m else None


def parse_job(text: str) -> Optional[JobState]:
    """A JobState from ``scontrol show job -o <id>``'s output (None: not a job's line)."""
    state = _field(text, "JobState")
    if state is None:
        return None
    preempt = _field(text, "PreemptTime")
    return JobState(state=state, restarts=int(_field(text, "Restarts") or 0),
                    preempting=preempt not in (None, "", "None", "Unknown"),
                    reason=_field(text, "Reason") or "")


def _ask(args: list[str], timeout: float = ASK_TIMEOUT_S) -> Optional[str]:
    """A SLURM command's output, or None when SLURM is not here or does not answer."""
    if shutil.which(args[0]) is None:
        return None
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.debug("%s did not answer: %s", " ".join(args), e)
        return None
    if out.returncode != 0:
        log.debug("%s: %s", " ".join(args), out.stderr.strip())
        return None
    return out.stdout


def job_state(job_id: str) -> Optional[JobState]:
    """The job as SLURM's controller says it now (None: it does not know the job, or does not
    answer)."""
    out = _ask(["scontrol", "show", "job", "-o", str(job_id).split("_")[0]])
    return parse_job(out) if out else None


def requeue(job_id: str) -> Optional[str]:
    """Ask SLURM to requeue the job; None on success, else SLURM's reason."""
    try:
        out = subprocess.run(["scontrol", "requeue", str(job_id)], capture_output=True,
                             text=True, timeout=ASK_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if out.returncode == 0 else (out.stderr.strip() or f"exit {out.returncode}")


@dataclass(frozen=True)
class PartitionFacts:
    """What a job in a partition gets, as SLURM's configuration says."""

    name: str
    node_memory_mb: Optional[int]  # the smallest RealMemory of its nodes (MiB, SLURM's MB)
    grace_s: int  # GraceTime: how long a preempted job keeps running after its first SIGTERM
    kill_wait_s: int  # KillWait: from SIGTERM to SIGKILL when a job is stopped

    @property
    def stop_warning_s(self) -> int:
        """The most time between SLURM's first SIGTERM and its SIGKILL (a preemption's grace
        time, then the kill sequence)."""
        return self.grace_s + self.kill_wait_s


def parse_partitions(text: str) -> dict[str, dict[str, str]]:
    """``scontrol show partition -o``: each partition's fields (the default one also under
    ``""``)."""
    out: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "PartitionName" not in fields:
            continue
        out[fields["PartitionName"]] = fields
        if fields.get("Default") == "YES":
            out[""] = fields
    return out


def parse_memory(text: str) -> Optional[int]:
    """The smallest node memory of ``sinfo -h -o %m`` lines ("15000", "64000+")."""
    values = [int(m) for m in re.findall(r"^\s*(\d+)", text, re.M)]
    return min(values) if values else None


def parse_kill_wait(text: str) -> int:
    """KillWait of ``scontrol show config`` ("KillWait = 30 sec")."""
    m = re.search(r"^KillWait\s*=\s*(\d+)", text, re.M)
    return int(m.group(1)) if m else DEFAULT_KILL_WAIT_S


def partition_facts(partition: Optional[str]) -> Optional[PartitionFacts]:
    """The partition's facts (None: the default one), or None where SLURM does not answer
    (a laptop's dry run, a workstation without a controller). Asked once per process."""
    return _partition_facts(partition or "", os.environ.get("SLURM_CONF", ""))


@functools.lru_cache(maxsize=None)
def _partition_facts(partition: str, _conf: str) -> Optional[PartitionFacts]:
    parts = _ask(["scontrol", "show", "partition", "-o"], PLAN_TIMEOUT_S)
    if parts is None:
        return None
    fields = parse_partitions(parts).get(partition)
    if fields is None:
        return None  # an unknown partition: sbatch says so at submission
    name = fields["PartitionName"]
    memory = _ask(["sinfo", "-h", "-p", name, "-o", "%m"], PLAN_TIMEOUT_S)
    config = _ask(["scontrol", "show", "config"], PLAN_TIMEOUT_S) or ""
    return PartitionFacts(name=name, node_memory_mb=parse_memory(memory or ""),
                          grace_s=int(fields.get("GraceTime", "0") or 0),
                          kill_wait_s=parse_kill_wait(config))
