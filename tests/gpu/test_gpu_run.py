"""The default command on a CUDA machine: every local GPU, nccl, bf16; MFU and CUDA memory logged.

Skipped without CUDA (CI never has one); run on a lent GPU with `pytest -m gpu tests/gpu`.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_default_command_uses_every_gpu_with_nccl(tmp_path):
    out = subprocess.run([sys.executable, "-m", "llama_fsdp", "precision=bf16", "train.max_steps=20",
                          "train.warmup_steps=2", "eval.every_steps=10"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "cuda (nccl)" in log
    assert f"{torch.cuda.device_count()} = 1 node(s) x {torch.cuda.device_count()}" in log
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/outputs/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("llama_fsdp").experiment_id])[0]
    m = run.data.metrics
    assert {"mfu", "peak_memory_gb", "peak_memory_reserved_gb", "tokens_per_sec"} <= set(m)
    assert 0 < m["mfu"] < 1 and m["peak_memory_reserved_gb"] >= m["peak_memory_gb"] > 0
    losses = [x.value for x in client.get_metric_history(run.info.run_id, "loss")]
    assert losses[-1] < losses[0]
