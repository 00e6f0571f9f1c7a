"""The command line checks and plans a run without importing torch or transformers: a dry run,
a refused override and a plan answer in well under a second instead of the 3-4 s those imports
take (measured: 4.0 s -> 0.5 s for ``python -m llama_fsdp dry_run=true``), and every launch's
driver starts that much sooner. checkpoint/checks.py, the checkpoint package's lazy names and
hf_dir.py keep it so; this test fails if an import drags them back in."""
from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
from llama_fsdp.cli.command import main
sys.argv = ["llama_fsdp", *{device}, "dry_run=true", "hydra.run.dir={out}",
            "tracking.enabled=false"]
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print("HEAVY", heavy)
"""


@pytest.mark.parametrize("device", [["cluster.device=cpu"], []], ids=["cpu", "auto"])
def test_a_dry_run_imports_neither_torch_nor_transformers(tmp_path, device):
    """cluster.device=auto (the default) on a host without a GPU driver finds no GPU without
    asking torch (launchers/hosts.py: 1.76-1.86 s -> 0.67-0.70 s for the default dry run)."""
    from llama_fsdp.launchers.hosts import no_gpu_driver

    if not device and not no_gpu_driver():
        pytest.skip("a GPU driver is here: cluster.device=auto asks torch for its GPUs")
    r = subprocess.run([sys.executable, "-c", PROBE.format(out=tmp_path / "run", device=device)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "dry_run=true: nothing launched" in r.stdout + r.stderr
    assert "HEAVY []" in r.stdout, r.stdout[-500:]
