"""tests/cpu_account.py: the CPU-seconds a test costs, its child processes' included, and the
table by scope."""
from __future__ import annotations

import json
import subprocess
import sys

from tests import cpu_account
from tests.conftest import REPO, _scope

# a fresh interpreter joins a cgroup of its own, then a child of it burns CPU for 0.6 s and ends
BURN = """
import json, subprocess, sys
from pathlib import Path
from tests.cpu_account import Account
a = Account(Path(sys.argv[1]), "w")
before = a.usage()
subprocess.run([sys.executable, "-c",
                "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass"],
               check=True)
print(json.dumps({"counted": a.usage() - before, "problem": a.problem}))
"""


def test_a_child_process_s_cpu_counts_to_the_test_that_started_it(tmp_path):
    out = subprocess.run([sys.executable, "-c", BURN, str(tmp_path)], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    r = json.loads(out)
    if r["problem"] is None:  # root with a cpuacct hierarchy, as CI has
        assert 0.55 <= r["counted"] <= 5, r
    else:  # elsewhere it says why and counts nothing, rather than a wrong number
        assert "no cpuacct cgroup" in r["problem"] and r["counted"] == 0, r


def test_the_table_sums_each_scope_over_the_workers_most_cpu_first(tmp_path):
    for worker, tests in (("gw0", {"tests/unit/test_a.py::t1": {"cpu": 3.0, "wall": 2.0},
                                   "tests/integration/test_slurm_launch.py::x": {"cpu": 1.0,
                                                                                  "wall": 9.0}}),
                          ("gw1", {"tests/unit/test_a.py::t2": {"cpu": 2.0, "wall": 3.0},
                                   "tests/integration/test_slurm_faults.py::y": {"cpu": 1.4,
                                                                                  "wall": 11.0}})):
        (tmp_path / f"{worker}.json").write_text(json.dumps(
            {"worker": worker, "total_cpu": 5.0, "problem": None, "tests": tests}))
    rows = cpu_account.table(tmp_path, _scope).splitlines()
    assert rows[2] == "| `tests/unit/test_a.py` | 5 | 5 | 1.00 |"
    assert rows[3] == "| `slurm` | 2 | 20 | 0.12 |"  # the SLURM modules are one scope
    assert rows[-1].startswith("CPU counted in tests: 7 s; every worker's cgroup over its "
                               "whole session: 10 s")  # 3 + 1 + 2 + 1.4 in tests; 5 + 5 in all
