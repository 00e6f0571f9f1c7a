"""How a launch fails, as the user reads it: the job failed (the first rank to fail leads,
with its report), one attempt's ranks failed, or the launcher itself was stopped."""
from __future__ import annotations

from typing import Any

from .rank import format_report


class LaunchError(RuntimeError):
    """The job failed; the message leads with the rank that failed first."""


class RankFailure(LaunchError):
    """One attempt failed: its rank reports, cause first."""

    def __init__(self, job_id: str, reports: list[dict[str, Any]]):
        self.reports = reports
        super().__init__(failure_message(job_id, reports))


class Interrupted(LaunchError):
    """The launcher was stopped by a signal; ``exit_code`` is the shell's 128 + signal."""

    def __init__(self, signum: int, message: str):
        self.exit_code = 128 + signum
        super().__init__(message)


class StoppedBeforeLaunch(KeyboardInterrupt):
    """A signal while the job was being prepared, before any rank started. A KeyboardInterrupt,
    so that no ``except Exception`` on the way (a data hook's error report) takes it for the
    step's own failure; ``exit_code`` is the shell's 128 + signal."""

    def __init__(self, signum: int, message: str):
        self.exit_code = 128 + signum
        super().__init__(message)


def failure_message(job_id: str, reports: list[dict[str, Any]]) -> str:
    """The cause (the earliest rank to fail that was not echoing another) first, then one line
    per rank that failed after it."""
    first, rest = reports[0], reports[1:]
    lines = [f"job {job_id} failed; the first rank to fail:", format_report(first)]
    for r in rest:
        last = (r.get("traceback") or "").strip().splitlines()[-1:] or [
            f"signal {r['signal_name']}" if r.get("signal") else f"exit code {r['exitcode']}"]
        lines.append(f"  then rank {r['rank']} on {r['host']}: {last[0]}")
    return "\n".join(lines)

