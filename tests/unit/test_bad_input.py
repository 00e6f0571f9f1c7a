"""Bad input is named before anything expensive starts: numbers that are not finite or out of
range, damaged model files, a callback that does not import, a binary data file, names that
would leave their folder."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llama_fsdp.run.spec import ConfigError
from tests.conftest import make_spec
from tests import warm


@pytest.mark.parametrize("override,message", [
    ("train.lr=nan", "train.lr=nan must be a finite number > 0"),
    ("train.lr=inf", "train.lr=inf must be a finite number > 0"),
    ("train.max_grad_norm=nan", "train.max_grad_norm=nan must be a finite number >= 0"),
    ("train.beta1=1.5", "train.beta1=1.5 must be in [0, 1)"),
    ("train.beta2=nan", "train.beta2=nan must be a finite number in [0, 1)"),
    ("train.weight_decay=-1", "train.weight_decay=-1.0 must be >= 0"),
    ("train.eps=0", "train.eps=0.0 must be > 0"),
    ("train.min_lr_ratio=nan", "train.min_lr_ratio=nan must be a finite number in [0, 1]"),
    ("model.init_std=nan", "model.init_std=nan must be a finite number > 0"),
    ("model.rms_norm_eps=-1e-5", "model.rms_norm_eps=-1e-05 must be > 0"),
    ("cluster.mem_gb=-8", "cluster.mem_gb=-8 must be >= 1"),
    ("cluster.timeout_min=-5", "cluster.timeout_min=-5 must be >= 1"),
    ("cluster.peak_tflops=inf", "cluster.peak_tflops=inf must be a finite number > 0"),
    ("tracking.final_delivery_s=nan", "tracking.final_delivery_s=nan must be a finite number"),
    ("eval.max_batches=0", "eval.max_batches=0 must be >= 1"),
    ("finetune=lora finetune.alpha=inf", "finetune.alpha=inf must be a finite number > 0"),
    ("tracking.best_mode=lowest", "tracking.best_mode='lowest': valid: min, max"),
    ("tracking.best_metric=", "tracking.best_metric is empty: name the end-of-run metric"),
    # (issue 63: accepted, then every sweep's best point was "none yet")
    ("tracking.best_metric=summary/eval_los", "tracking.best_metric='summary/eval_los' is no "
     "metric a run logs, so no sweep point would have it; the closest: summary/eval_loss"),
    # (issue 63: 1e-30 trained nothing without a word)
    ("train.lr=1e-30", "train.lr=1e-30 is below 1e-12: steps that small are rounded away"),
])
def test_numbers_are_finite_and_in_range_at_compose(override, message, tmp_path):
    """Before: NaN and infinity passed every check and trained silently; beta1=1.5,
    weight_decay=-1 and eps=0 failed inside the ranks; a negative mem_gb or timeout_min made
    a bogus plan and #SBATCH line."""
    with pytest.raises(ConfigError) as e:
        make_spec(override.split(), output_dir=tmp_path)
    assert message in str(e.value)


def test_a_negative_max_steps_suggests_no_invalid_warmup(tmp_path):
    """Before: train.max_steps=-5 suggested train.warmup_steps=-1."""
    with pytest.raises(ConfigError) as e:
        make_spec(["train.max_steps=-5"], output_dir=tmp_path)
    assert "train.max_steps=-5 must be >= 1" in str(e.value)
    assert "warmup_steps=-" not in str(e.value)


def _tiny_hf(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from llama_fsdp.config.schema import model_preset
    from llama_fsdp.model.llama import llama_config

    cfg: LlamaConfig = llama_config(model_preset("tiny"))
    LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="2MB")
    return path


def test_damaged_model_files_are_named_before_launch(tmp_path):
    """Before: a truncated model.safetensors passed every check (the ranks then failed with a
    60-line DCP traceback naming neither file nor fix); a malformed config.json raised a raw
    JSONDecodeError."""
    hf = _tiny_hf(tmp_path / "hf")
    make_spec([f"model.path={hf}"], output_dir=tmp_path / "r")  # intact: accepted
    shard = sorted(hf.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(ConfigError) as e:
        make_spec([f"model.path={hf}"], output_dir=tmp_path / "r")
    assert f"{shard} has {shard.stat().st_size} bytes but its header describes " \
           f"{shard.stat().st_size + 1000}: truncated" in str(e.value)
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(ConfigError, match=f"{shard} has a damaged safetensors header"):
        make_spec([f"model.path={hf}"], output_dir=tmp_path / "r")
    shard.unlink()
    (hf / "config.json").write_text('{"hidden_size": 256,')
    with pytest.raises(ConfigError) as e:
        make_spec([f"model.path={hf}"], output_dir=tmp_path / "r")
    assert f"{hf / 'config.json'} is not valid JSON" in str(e.value)
    assert f"names {shard.name}, which is not in {hf}" in str(e.value)  # the index's missing file


def test_a_bad_callback_is_named_before_any_rank_starts(tmp_path):
    """Before: train.callbacks were imported only on the ranks, after the model was built."""
    (tmp_path / "mycb.py").write_text("def ok(**kw):\n    return lambda s: None\n"
                                      "NOT_A_FACTORY = 3\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}
    for callbacks, message in (("[mycb:nope]", "module 'mycb' has no 'nope'"),
                               ("[no_such_module:f]", "'no_such_module:f' cannot be imported"),
                               ("[mycb:NOT_A_FACTORY]", "is a int, not a factory")):
        out = subprocess.run([warm.python(), "-m", "llama_fsdp", "cluster.device=cpu",
                              "tracking.enabled=false", f"train.callbacks={callbacks}",
                              f"output_dir={tmp_path}/run"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
        log = out.stdout + out.stderr
        assert out.returncode == 2 and message in log, log[-3000:]
        assert "started" not in log and "tokenizing" not in log  # before data, before ranks
    make_spec(["train.callbacks=[mycb:ok]"], output_dir=tmp_path / "r")


def test_a_binary_data_file_is_named_as_not_text(tmp_path):
    """Before: a gzip'd (or any binary) .jsonl was reported as "line 1: malformed JSON"."""
    import gzip

    from llama_fsdp.data.sources import _load_files

    data = tmp_path / "train.jsonl"
    data.write_bytes(gzip.compress(b'{"text": "hello"}\n' * 50))
    with pytest.raises(ValueError) as e:
        _load_files(str(data), tmp_path / "cache")
    assert str(e.value).startswith(f"{data}: not a text file (gzip-compressed: byte 1")
    data.write_text('{"text": "h\u00e9llo"}\n' * 50)  # UTF-8 beyond ASCII is text
    assert len(_load_files(str(data), tmp_path / "cache").records) == 50


def test_names_that_become_paths_stay_in_their_folder(tmp_path):
    """Before: `../` in a torchrun run id or in tracking.experiment escaped outputs/runs and
    mlartifacts/."""
    from llama_fsdp.tracking.store import artifact_location

    db = tmp_path / "outputs" / "mlflow.db"
    for name in ("../../escaped", "..", "a/b", "x\\y"):
        where = Path(artifact_location(f"sqlite:///{db}", name)[len("file://"):])
        assert where.parent == tmp_path / "outputs" / "mlartifacts", where
    assert artifact_location(f"sqlite:///{db}", "llama_fsdp").endswith("/mlartifacts/llama_fsdp")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "../../../escaped"}
    out = subprocess.run([warm.python(), "-m", "llama_fsdp", "cluster=torchrun",
                          "cluster.device=cpu", "dry_run=true"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, (out.stdout + out.stderr)[-3000:]
    assert "torchrun's run id (--rdzv-id)='../../../escaped' becomes a folder name" in out.stderr


@pytest.mark.parametrize("override,message", [
    ("train.seed=-1", "train.seed=-1 must be in [0, 4294967295]"),
    ("train.seed=18446744073709551616", "train.seed=18446744073709551616 must be in [0, "),
    ("cluster.init_timeout_s=100000000000000000000", "cluster.init_timeout_s=100000000000000000000"
                                                     " is longer than 604,800 s"),
    ("train.grad_accum=4611686018427387904", "train.grad_accum=4611686018427387904 is more than "
                                             "any run needs (at most 65,536)"),
    ("cluster.nodes=1000000", "cluster.nodes=1000000 is more than any run needs"),
    ("cluster.threads_per_rank=1000000", "cluster.threads_per_rank=1000000 is more than any run"),
    ("data.num_proc=1000000", "data.num_proc=1000000 is more than any run needs (at most 512)"),
    ("cluster=slurm cluster.timeout_min=2 cluster.signal_delay_s=600",
     "cluster.signal_delay_s=600 is not before the end of the job's cluster.timeout_min=2"),
])
def test_every_number_that_reaches_an_allocation_a_loop_or_a_timer_is_bounded(override, message,
                                                                             tmp_path):
    """Before: a negative or 2**64 seed, a timeout of 1e20 s, grad_accum=2**62, a million nodes,
    threads or tokenizer processes, and a SLURM signal after the time limit were accepted."""
    with pytest.raises(ConfigError) as e:
        make_spec(override.split(), output_dir=tmp_path)
    assert message in str(e.value)


def test_a_billion_layers_is_refused_before_anything_is_planned(tmp_path):
    """Before: model.num_layers=1e9 raised MemoryError, even under dry_run."""
    r = subprocess.run([warm.python(), "-m", "llama_fsdp", "cluster.device=cpu", "dry_run=true",
                        "model.num_layers=1000000000"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "model.num_layers=1000000000 is larger than any Llama's: at most 4,096" in r.stderr
    assert "MemoryError" not in r.stderr


def test_a_home_relative_output_dir_is_the_homes(tmp_path, monkeypatch):
    """Before: output_dir='~/x' made a folder literally named ~ in the launch directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    spec = make_spec(["tracking.uri='sqlite:///~/mlflow.db'", "cache_dir='~/cache'"],
                     output_dir="'~/runs/x'")
    assert spec.output_dir == str(tmp_path / "home" / "runs" / "x")
    assert spec.tracking_uri == f"sqlite:///{tmp_path}/home/mlflow.db"
    assert spec.cache_dir == str(tmp_path / "home" / "cache")


@pytest.mark.parametrize("where", ["file", "proc"])
def test_a_run_directory_that_cannot_be_made_is_one_line(tmp_path, where):
    """Before: an output_dir below a file, or on /proc, ended in a raw OSError traceback."""
    (tmp_path / "a_file").write_text("x")
    out = {"file": tmp_path / "a_file" / "run", "proc": Path("/proc/llama_fsdp_test_run")}[where]
    r = subprocess.run([warm.python(), "-m", "llama_fsdp", "cluster.device=cpu",
                        f"output_dir={out}", "tracking.enabled=false"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    if where == "file":  # (issue 63: said before the plan, by the CLI's Hydra callback)
        assert f"output_dir={out} cannot be made: {tmp_path / 'a_file'} is a file, not a " \
            "folder. Pick a writable folder: output_dir=<a folder you may write>" in r.stderr
    else:  # root may write below /proc's folder: said when the run directory is made
        assert f"cannot make the run directory {out}" in r.stderr
        assert "choose an output_dir where you may write" in r.stderr
    assert "Traceback" not in r.stderr and "HYDRA_FULL_ERROR" not in r.stderr


def test_convert_to_a_path_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "out").write_text("a file of the user's")
    r = subprocess.run([warm.python(), "-m", "llama_fsdp.convert", str(tmp_path),
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "is a file, not a directory" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert (tmp_path / "out").read_text() == "a file of the user's"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare to mount a read-only folder")
def test_a_launch_from_a_read_only_folder_is_one_line(tmp_path):
    """Before: even a dry run from a read-only folder ended in Hydra's OSError traceback."""
    ro = tmp_path / "ro"
    ro.mkdir()
    script = (f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} && cd {ro} && "
              f"{sys.executable} -m llama_fsdp cluster.device=cpu dry_run=true")
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert r.returncode == 2, r.stdout[-1000:] + r.stderr[-2000:]
    assert f"{ro} is not writable: llama_fsdp keeps each launch's folder under outputs/runs" \
        in r.stderr
    assert "Traceback" not in r.stderr and "OSError" not in r.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare to mount a read-only folder")
@pytest.mark.parametrize("args,key", [
    (["hydra.run.dir={ro}/run"], "hydra.run.dir"),
    (["output_dir={ro}/run"], "output_dir"),
    (["-m", "hydra.sweep.dir={ro}/sweep", "train.lr=1e-3,2e-3"], "hydra.sweep.dir"),
])
def test_a_run_folder_on_a_read_only_mount_is_one_line_before_any_work(tmp_path, args, key):
    """Before (issue 63 item 12): hydra.run.dir on a read-only mount ended in Hydra's OSError
    traceback (Hydra makes it before our code runs); output_dir was refused only after the plan
    and the job's controller had started. A real read-only bind mount (as root, chmod stops no
    write), in a mount namespace of its own; the launch folder is writable."""
    ro = tmp_path / "ro"
    ro.mkdir()
    argv = " ".join(a.format(ro=ro) for a in args)
    script = (f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} && "
              f"{sys.executable} -m llama_fsdp {argv} cluster.device=cpu train.max_steps=2")
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert f"{key}={ro}/{'sweep' if 'sweep' in key else 'run'} cannot be made: {ro} is on a " \
        f"read-only mount. Pick a writable folder: {key}=<a folder you may write>" in out, out
    assert "Traceback" not in out and "OSError" not in out
    assert "plan:" not in out  # before the plan, the data, the ranks and the MLflow run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro"]  # no outputs/, no mlflow.db


def test_a_dry_run_sweep_leaves_no_mlflow_run_and_no_sweep_folder(tmp_path):
    """Before (issue 63): `-m ... dry_run=true` left a RUNNING MLflow parent run and the sweep's
    folder (multirun.yaml, its tracking spool)."""
    db = tmp_path / "mlflow.db"
    r = subprocess.run([warm.python(), "-m", "llama_fsdp", "-m", "train.lr=1e-3",
                        "cluster.device=cpu", "dry_run=true", f"tracking.uri=sqlite:///{db}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (tmp_path / "outputs").exists(), sorted(map(str, tmp_path.rglob("*")))
    if db.exists():  # (no run at all; a store MLflow made is the user's to keep)
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{db}")
        assert [r.info.status for e in client.search_experiments()
                for r in client.search_runs([e.experiment_id])] == []
    assert "dry_run=true: the sweep's points were planned; nothing launched" in \
        r.stdout + r.stderr


def test_every_metric_a_run_logs_can_pick_the_best_point(tmp_path, caplog):
    """The names the sweeps, docs and tests use pass; a huge lr is said, not refused (the
    guard's own tests train at 3.0 and 1e20)."""
    for name in ("summary/eval_loss", "summary/final_loss", "summary/tokens_per_sec",
                 "harness score", "harness/arc_easy/acc", "summary/eval_reward_accuracy",
                 "eval_rewards/margin", "summary/eval_dpo_loss"):
        make_spec([f"tracking.best_metric={name}"], output_dir=tmp_path)
    with caplog.at_level("WARNING", logger="llama_fsdp.run.checks"):
        make_spec(["train.lr=1e20"], output_dir=tmp_path)
    assert "train.lr=1e+20 is above 10, far above any recipe's" in caplog.text


def test_a_swept_value_with_a_line_break_keeps_the_run_name_on_one_line():
    """Before (issue 63): the run name held the line break, which broke MLflow's table and the
    sweep's summary."""
    from llama_fsdp.run.spec import point_name

    assert point_name({"data.prompt_template": "Q: {instruction}\nA:\t", "train.lr": "3e-4"}) \
        == "prompt_template=Q: {instruction}\\nA:\\t lr=3e-4"
