"""The command users type, on every visible GPU: each sharding strategy, precision, activation
checkpointing, compile, CPU offload, HF weights in and out, resume; MFU and CUDA memory logged.

Skipped without CUDA (CI never has one); run on a GPU machine with `pytest -m gpu tests/gpu`.
What these tests check of a run (``assert_trains``, ``assert_export_is_the_trained_start``)
is also checked on CPU runs, by the same helpers: tests/integration/test_sweep_local.py.
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


# A real drop, not noise (one step's loss swings by up to 0.6 on the synthetic task): the mean
# of the last 3 logged losses at least this far below the mean of the first 3. SHORT's run on 2
# CPU ranks (fp32) falls by 2.35, from 5.28 to 2.93.
TRAINS_DROP = 1.0


def assert_trains(losses: list[float], steps: int) -> None:
    """Every step logged, and the loss fell by a real margin (TRAINS_DROP)."""
    assert len(losses) == steps, losses
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - TRAINS_DROP, (first, last, losses)


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
    assert_trains([x.value for x in client.get_metric_history(run.info.run_id, "loss")], 20)
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
    assert_trains([x.value for x in client.get_metric_history(run.info.run_id, "loss")], 12)
    m = run.data.metrics
    record_property("result", {"config": f"tiny {name}, the command line",
                               "measured_gb": m["summary/peak_memory_gb"],
                               "predicted_gb": m["summary/predicted_peak_memory_gb"],
                               "tokens_per_s": m["summary/tokens_per_sec"]})
    print(f"{name}: {m['summary/tokens_per_sec']:.0f} tok/s, peak "
          f"{m['summary/peak_memory_gb']:.3f} GB (plan {m['summary/predicted_peak_memory_gb']:.3f})")


PROBE = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(7))
# the export against the run's start, per 2-D weight: training moved it, and it is still that
# start moved: cosine above this. SHORT's run on 2 CPU ranks: 0.60 to 0.98; against an unrelated
# init of the same shapes (another seed) at most 0.012.
MIN_COSINE = 0.3


def _logits(model) -> torch.Tensor:
    """fp32 logits of the probe batch on the CPU (as tests/multirank/test_checkpoint.py)."""
    with torch.no_grad():
        return model.float().eval()(input_ids=PROBE).logits.float()


def initial_model(run_dir: Path, config):
    """The run's weights at step 0, on the CPU: its resolved config (config.yaml) through the
    library's init, which draws the same values for any world size and sharding
    (llama_fsdp.model.llama.init_weights)."""
    from omegaconf import OmegaConf
    from transformers import LlamaForCausalLM

    from llama_fsdp.model.llama import init_weights
    from llama_fsdp.config.rundir import RunDir

    cfg = OmegaConf.load(RunDir(run_dir).config)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        init_weights(model, std=cfg.model.init_std, seed=cfg.train.seed)
    return model


def assert_export_is_the_trained_start(run_dir: Path, export: Path, step: int) -> None:
    """The exported HF model is the run's trained model: the logits of its last checkpoint
    (step ``step``, read apart from the export's gather), and its step-0 weights moved by
    training (every 2-D weight changed, and still correlated with its start: MIN_COSINE)."""
    from transformers import LlamaForCausalLM

    from llama_fsdp.checkpoint import layout, read_model_state

    exported = LlamaForCausalLM.from_pretrained(export)
    trained = LlamaForCausalLM(exported.config)
    missing, unexpected = trained.load_state_dict(
        read_model_state(layout.step_dir(run_dir, step)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    trained.tie_weights()
    torch.testing.assert_close(_logits(exported), _logits(trained), rtol=1e-5, atol=1e-5)
    start = dict(initial_model(run_dir, exported.config).named_parameters())
    for name, w in exported.named_parameters():
        if w.dim() != 2:
            continue
        w, w0 = w.detach().float().flatten(), start[name].detach().float().flatten()
        cosine = float(w @ w0 / (w.norm() * w0.norm()))
        assert not torch.equal(w, w0) and cosine > MIN_COSINE, (name, cosine)


def test_hf_weights_in_export_out_and_resume(tmp_path):
    """Export a trained model, fine-tune from it (model.path: per-shard HF load), stop in the
    middle with a checkpoint, resume it (no second HF read), export again; the resumed steps'
    losses are an uninterrupted run's."""
    # the final checkpoint (save.every_steps=12) holds the trained weights
    code, log = _run(tmp_path, *SHORT, "save.export_hf=true", "save.every_steps=12")
    assert code == 0, log[-4000:]
    _, first = _run_record(tmp_path)
    export = Path(first.data.tags["export_dir"])
    assert_export_is_the_trained_start(Path(first.data.tags["output_dir"]), export, 12)
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
    # what it resumed to: steps 9-12 as an uninterrupted run of the same command takes them
    whole = tmp_path / "uninterrupted"
    code, log = _run(tmp_path, *SHORT, f"model.path={export}", "save.every_steps=4",
                     f"output_dir={whole}")
    assert code == 0, log[-4000:]
    resumed, straight = _losses_by_step(tmp_path, run_dir), _losses_by_step(tmp_path, whole)
    assert sorted(resumed) == sorted(straight) == list(range(1, 13)), (resumed, straight)
    for step in range(9, 13):
        assert resumed[step] == pytest.approx(straight[step], rel=RESUME_RTOL), (
            step, resumed, straight)


# The resumed steps' losses against an uninterrupted run's: CUDA's kernels are not bitwise
# deterministic run to run (atomic adds in the backward), so close, not equal. A resume from the
# wrong weights (the start: a loss TRAINS_DROP higher) or the wrong batches (a step's loss swings
# by up to 0.6 on the synthetic task) is far outside.
RESUME_RTOL = 2e-2


def _losses_by_step(cwd: Path, run_dir: Path) -> dict[int, float]:
    """The MLflow run of ``run_dir`` (a resumed run continues its run): its loss per step."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{cwd}/outputs/mlflow.db")
    exp = client.get_experiment_by_name("llama_fsdp")
    (run,) = [r for r in client.search_runs([exp.experiment_id])
              if Path(r.data.tags.get("output_dir", "")).resolve() == run_dir.resolve()]
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
