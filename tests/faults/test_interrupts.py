"""Interrupts end tidily: Ctrl-C or SIGTERM while the job is being prepared prints one line and
leaves nothing of the launch behind; a Ctrl-C while the MLflow run is being closed waits for it.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.faults import hooks
from tests.faults.conftest import start_cli

pytestmark = [pytest.mark.slow]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_during_data_preparation_says_one_line_and_leaves_nothing(tmp_path, sig):
    """Before: Ctrl-C printed about 100 lines of traceback; SIGTERM left owner.json and
    owner.lock behind."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"say {i}", "input": "", "output": str(i)})
                            + "\n" for i in range(400)))
    run = tmp_path / "run"
    run.mkdir()  # (an empty folder the user made: it stays, empty)
    marker = tmp_path / "prep_started"
    p = start_cli(tmp_path, "data=jsonl", f"data.path={data}",
                  "data.preprocess=tests.faults.hooks:slow_preprocess", f"output_dir={run}",
                  "tracking.enabled=false", env={hooks.PREP_STARTED: str(marker)})
    deadline = time.monotonic() + 120
    while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), p.communicate()[0][-3000:]
    os.kill(p.pid, sig)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 128 + sig, out[-3000:]
    assert f"stopped by {signal.Signals(sig).name} while the job was being prepared: nothing was " \
           "launched" in out
    assert "Traceback" not in out, out[-3000:]
    assert list(run.iterdir()) == []  # no owner.json, no owner.lock, no config.yaml
