"""The command users type, on every visible GPU: each sharding strategy, precision, activation
checkpointing, compile, CPU offload, HF weights in and out, resume; MFU and CUDA memory logged.

Skipped without CUDA (CI never has one); run on a GPU machine with `pytest -m gpu tests/gpu`.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHORT = ["train.max_steps=12", "train.warmup_steps=2", "eval.every_steps=6",
         "eval.task_prompts=8", "cluster.device=cuda"]


def _run(cwd: Path, *overrides: str, timeout: int = 900) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-m", "llama_fsdp", *overrides], cwd=cwd,
                         capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                             str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")]))})
    return out.returncode, out.stdout + out.stderr


def _run_record(cwd: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{cwd}/outputs/mlflow.db")
    exp = client.get_experiment_by_name("llama_fsdp")
    runs = [r for r in client.search_runs([exp.experiment_id])
            if r.data.tags.get("llama_fsdp.kind") != "sweep"]
    return client, max(runs, key=lambda r: r.info.start_time)


def test_default_command_uses_every_gpu_with_nccl(tmp_path):
    n = torch.cuda.device_count()
    code, log = _run(tmp_path, "train.max_steps=20", "train.warmup_steps=2",
                     "eval.every_steps=10")
    assert code == 0, log[-4000:]
    assert "cuda (nccl)" in log and f"{n} = 1 node(s) x {n}" in log
    assert "precision                      mixed" in log  # precision=auto on CUDA
    # model.attn_implementation=auto on CUDA with packed rows in bf16: flash varlen, no mask
    assert re.search(r"attention\s+varlen", log), log[-4000:]
    client, run = _run_record(tmp_path)
    m = run.data.metrics
    assert {"mfu", "peak_memory_gb", "peak_memory_reserved_gb", "tokens_per_sec",
            "summary/mfu"} <= set(m)
    assert 0 < m["mfu"] < 1 and m["peak_memory_reserved_gb"] >= m["peak_memory_gb"] > 0
    losses = [x.value for x in client.get_metric_history(run.info.run_id, "loss")]
    assert losses[-1] < losses[0]
    print(f"default on {n} GPU(s): {m['summary/tokens_per_sec']:.0f} tok/s, "
          f"MFU {m['summary/mfu']:.2%}, peak {m['summary/peak_memory_gb']:.2f} GB")


OPTIONS = {
    "full-bf16": ["sharding=full", "precision=bf16"],
    "grad_op-mixed": ["sharding=grad_op", "precision=mixed"],
    "no_shard-mixed": ["sharding=no_shard", "precision=mixed"],
    "hybrid": ["sharding=hybrid", "sharding.shard_size=1"],
    "fp32-tf32": ["precision=fp32"],
    "ac-full": ["checkpointing=full"],
    "ac-selective": ["checkpointing=selective"],
    "compile": ["train.compile=true"],
    "cpu-offload": ["sharding.cpu_offload=true"],
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_each_option_trains_on_gpus(tmp_path, record_property, name):
    code, log = _run(tmp_path, *SHORT, *OPTIONS[name])
    assert code == 0, log[-4000:]
    if name == "fp32-tf32":
        assert "TF32 matmuls enabled" in log
    client, run = _run_record(tmp_path)
    losses = [x.value for x in client.get_metric_history(run.info.run_id, "loss")]
    assert len(losses) == 12 and losses[-1] < losses[0], losses
    m = run.data.metrics
    record_property("result", {"config": f"tiny {name}, the command line",
                               "measured_gb": m["summary/peak_memory_gb"],
                               "predicted_gb": m["summary/predicted_peak_memory_gb"],
                               "tokens_per_s": m["summary/tokens_per_sec"]})
    print(f"{name}: {m['summary/tokens_per_sec']:.0f} tok/s, peak "
          f"{m['summary/peak_memory_gb']:.3f} GB (plan {m['summary/predicted_peak_memory_gb']:.3f})")


PROBE = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(7))


def _logits(model) -> torch.Tensor:
    """fp32 logits of the probe batch on the CPU (as tests/multirank/test_checkpoint.py)."""
    with torch.no_grad():
        return model.float().eval()(input_ids=PROBE).logits.float()


def test_hf_weights_in_export_out_and_resume(tmp_path):
    """Export a trained model, fine-tune from it (model.path: per-shard HF load), stop in the
    middle with a checkpoint, resume it (no second HF read), export again."""
    from transformers import LlamaForCausalLM

    from llama_fsdp.checkpoint import layout, read_model_state

    # the final checkpoint (save.every_steps=12) holds the trained weights, read apart from the
    # export's gather: the exported model must give their logits, and differ from the start
    code, log = _run(tmp_path, *SHORT, "save.export_hf=true", "save.every_steps=12")
    assert code == 0, log[-4000:]
    _, first = _run_record(tmp_path)
    export = Path(first.data.tags["export_dir"])
    exported = LlamaForCausalLM.from_pretrained(export)
    trained = LlamaForCausalLM(exported.config)
    missing, unexpected = trained.load_state_dict(
        read_model_state(layout.step_dir(Path(first.data.tags["output_dir"]), 12)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    trained.tie_weights()
    torch.testing.assert_close(_logits(exported), _logits(trained), rtol=1e-5, atol=1e-5)
    untrained = LlamaForCausalLM(exported.config)  # another init: the export is not a fresh model
    assert not torch.allclose(_logits(exported), _logits(untrained), atol=1e-3)
    run_dir = tmp_path / "from_hf"
    common = [*SHORT, f"model.path={export}", "save.every_steps=4", f"output_dir={run_dir}",
              "save.export_hf=true"]
    code, log = _run(tmp_path, *common, "train.stop_after=8")
    assert code == 0, log[-4000:]
    assert f"tensors from {export}" in log  # the per-shard HF read
    code, log = _run(tmp_path, *common)
    assert code == 0, log[-4000:]
    assert "resumed from" in log and "step_000008" in log
    assert f"tensors from {export}" not in log  # resuming skipped the HF read
    assert (run_dir / "export" / "model.safetensors").exists()
