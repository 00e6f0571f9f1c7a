"""Launcher pieces that need no processes: failure reports name the cause first."""
from __future__ import annotations

import os

from launchers.common import _failure_message, rank_errors


class _Job:
    job_id = "42"


def test_failure_report_leads_with_the_earliest_rank_error(tmp_path):
    # rank 1 raised first; rank 0's collective then broke and it reported later
    (tmp_path / "rank0.error").write_text("rank 0 on n1:\nTraceback\nRuntimeError: Connection closed by peer")
    (tmp_path / "rank1.error").write_text("rank 1 on n1:\nTraceback\nValueError: the real cause")
    os.utime(tmp_path / "rank1.error", ns=(1_000_000_000, 1_000_000_000))
    os.utime(tmp_path / "rank0.error", ns=(2_000_000_000, 2_000_000_000))
    msg = _failure_message(_Job, rank_errors(str(tmp_path)))
    assert msg.index("ValueError: the real cause") < msg.index("Connection closed by peer")
    assert "first failing rank's error:\nrank 1 on n1:" in msg
    assert "then rank 0 on n1: RuntimeError: Connection closed by peer" in msg
