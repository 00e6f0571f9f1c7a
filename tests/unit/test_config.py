"""Composition of the real conf/ tree and validation into a RunSpec (pure, no processes)."""
from __future__ import annotations

import subprocess

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from llama_fsdp.run.spec import ConfigError
from tests.conftest import CONF, REPO, compose, make_spec
from tests import warm

GROUPS = ["model", "sharding", "precision", "checkpointing", "cluster", "data"]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_group_option_composes_into_a_spec(group, option, monkeypatch):
    if option == "torchrun":  # the environment torchrun gives each of its 2 processes
        for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
            monkeypatch.setenv(key, value)
    extra = {"cluster": ["cluster.nproc_per_node=2"], "sharding": ["cluster.nproc_per_node=2"],
             "data": [] if option == "synthetic" else ["data.path=/data/train.jsonl"]}
    overrides = [f"{group}={option}", *extra.get(group, [])]
    if group == "model" and option != "tiny":
        overrides.append("cluster.device=cpu")
    spec = make_spec(overrides)
    assert getattr(spec, group).__class__.__name__.lower().startswith(group[:4])
    if group == "model":
        assert spec.model.name == option
    if group == "sharding" and option != "auto":
        assert spec.strategy == option


def test_real_data_sources_need_a_path():
    with pytest.raises(ConfigError) as e:
        make_spec(["data=jsonl"])
    assert "data.name=jsonl needs data.path" in str(e.value)


def test_default_is_tiny_on_two_cpu_ranks_with_sqlite_mlflow():
    spec = make_spec()
    assert (spec.model.name, spec.device, spec.backend, spec.world_size) == ("tiny", "cpu", "gloo", 2)
    assert spec.tracking_uri == f"sqlite:///{REPO}/outputs/mlflow.db"
    assert spec.global_batch == spec.train.batch_size * spec.train.grad_accum * 2
    assert spec.tokens_per_step == spec.global_batch * spec.train.seq_len


def test_model_shapes_match_llama3_reference():
    m = make_spec(["model=70b", "cluster.device=cpu"]).model
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.intermediate_size) == (
        8192, 80, 64, 8, 28672)
    assert m.rope_scaling.factor == 8.0 and m.rope_scaling.original_max_position_embeddings == 8192
    assert make_spec(["model=1b", "cluster.device=cpu"]).model.rope_scaling.factor == 32.0
    assert make_spec(["model=3b", "cluster.device=cpu"]).model.tie_word_embeddings is True


def test_misspelled_key_fails_at_compose_with_its_name():
    with pytest.raises(ConfigCompositionException) as e:
        compose(["train.batchsize=4"])
    assert "batchsize" in str(e.value.__cause__ or e.value)


def test_misspelled_key_in_a_group_fails_with_its_name():
    with pytest.raises(ConfigCompositionException) as e:
        compose(["sharding.shardsize=2"])
    assert "shardsize" in str(e.value.__cause__ or e.value)


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(MissingConfigException) as e:
        compose(["sharding=foo"])
    msg = str(e.value)
    assert "foo" in msg
    for option in ("full", "grad_op", "no_shard", "hybrid", "hybrid_grad_op"):
        assert option in msg


def test_wrong_type_fails_with_the_key():
    with pytest.raises(ConfigCompositionException) as e:
        compose(["train.batch_size=abc"])
    cause = e.value.__cause__
    assert isinstance(cause, (ValidationError, ConfigKeyError))
    assert "batch_size" in str(cause)


@pytest.mark.parametrize("overrides,needle", [
    (["sharding=hybrid", "cluster.nproc_per_node=6", "sharding.shard_size=4"],
     "world size 6 is not divisible by sharding.shard_size=4: set sharding.shard_size to one of [1, 2, 3, 6]"),
    (["train.batch_size=0"], "train.batch_size=0 must be >= 1"),
    (["train.max_steps=5", "train.warmup_steps=5"], "train.warmup_steps=5"),
    (["sharding=full", "sharding.shard_size=1"], "use sharding=hybrid"),
    (["sharding.strategy=zero3"], "sharding.strategy='zero3' is not one of full, grad_op"),
    (["sharding.cpu_offload=true"], "sharding.cpu_offload=true needs CUDA"),
    (["cluster.nodes=2"], "use cluster=slurm for several nodes"),
    (["model.num_kv_heads=3"], "not divisible by model.num_kv_heads=3"),
    (["train.seq_len=4096"], "exceeds model.max_position_embeddings=2048"),
    (["resume=/nonexistent/ckpt"], "resume='/nonexistent/ckpt' does not exist"),
    (["model.attn_implementation=sdpaa"], "model.attn_implementation='sdpaa' is not one of auto"),
    (["cluster=slurm", "cluster.gpus_per_node=8", "cluster.device=auto", "model.attn_implementation=varlen",
      "precision=fp32"], "model.attn_implementation=varlen needs 16-bit compute on CUDA"),
])
def test_bad_values_are_refused_before_launch_with_the_fix(overrides, needle):
    with pytest.raises(ConfigError) as e:
        make_spec(overrides)
    assert needle in str(e.value)


@pytest.mark.parametrize("overrides,attn", [
    ([], "varlen"),  # CPU, packed rows: block-sparse SDPA
    (["data.packing=false"], "sdpa"),  # CPU, one record per row: SDPA's causal path
    (["model.attn_implementation=sdpa"], "sdpa"),  # CPU: transformers' block mask, as asked
    (["cluster=slurm", "cluster.gpus_per_node=8", "cluster.device=auto"], "varlen"),  # CUDA, mixed, packed rows
    (["cluster=slurm", "cluster.gpus_per_node=8", "cluster.device=auto", "data.packing=false"], "sdpa"),
    (["cluster=slurm", "cluster.gpus_per_node=8", "cluster.device=auto", "model.attn_implementation=eager"], "eager"),
])
def test_attention_auto_resolves_per_run(overrides, attn):
    spec = make_spec(overrides)
    assert spec.model.attn_implementation == attn


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as e:
        make_spec(["train.batch_size=0", "train.lr=-1", "precision.name=fp8"])
    assert len(e.value.problems) == 3


@pytest.mark.parametrize("strategy,nproc,shard_size,shape,reshard", [
    ("full", 4, None, (4,), True),
    ("grad_op", 4, None, (4,), False),
    ("no_shard", 4, None, (4, 1), False),
    ("hybrid", 4, 2, (2, 2), True),
    ("hybrid_grad_op", 4, 2, (2, 2), False),
    ("hybrid", 4, None, (4,), True),  # shard_size defaults to ranks per node: one node
])
def test_mesh_per_strategy(strategy, nproc, shard_size, shape, reshard):
    o = [f"sharding={strategy}", f"cluster.nproc_per_node={nproc}"]
    if shard_size:
        o.append(f"sharding.shard_size={shard_size}")
    spec = make_spec(o)
    assert spec.mesh.shape == shape and spec.mesh.reshard_after_forward is reshard
    assert spec.world_size == nproc


def test_slurm_hybrid_replicates_across_nodes_and_shards_within():
    spec = make_spec(["cluster=slurm", "cluster.nodes=4", "cluster.gpus_per_node=8", "cluster.device=auto",
                      "sharding=hybrid", "model=70b"])
    assert (spec.device, spec.backend, spec.world_size) == ("cuda", "nccl", 32)
    assert spec.mesh.shape == (4, 8) and spec.mesh.dim_names == ("replicate", "shard")


@pytest.mark.parametrize("precision,dtypes", [
    ("fp32", ("float32", "float32", "float32")),
    ("mixed", ("float32", "bfloat16", "float32")),
    ("bf16", ("bfloat16", "bfloat16", "bfloat16")),
])
def test_precision_policies(precision, dtypes):
    p = make_spec([f"precision={precision}"]).policy
    assert (p.param_dtype, p.compute_dtype, p.reduce_dtype) == dtypes


def test_cli_reports_a_bad_value_and_exits_nonzero(tmp_path):
    out = subprocess.run(
        [warm.python(), "-m", "llama_fsdp", "train.batch_size=0", f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "train.batch_size=0 must be >= 1" in out.stderr + out.stdout
    assert not (tmp_path / "submitit").exists()  # refused before anything was launched


def test_cli_unknown_option_lists_valid_ones(tmp_path):
    out = subprocess.run([warm.python(), "-m", "llama_fsdp", "sharding=foo"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "Available options in 'sharding'" in out.stderr and "hybrid_grad_op" in out.stderr


def test_experiment_presets_compose_with_the_values_they_leave_open():
    presets = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
    assert presets, "conf/experiment/ ships an example preset"
    for name in presets:
        cfg = compose([f"experiment={name}", "data.path=/data/alpaca.json", "cluster.device=cpu"])
        size = name.split("_")[1]  # llama3_<size>_...: the model the preset is for
        assert cfg.model.name == size and cfg.data.name == "jsonl", name
        assert cfg.data.path == "/data/alpaca.json"  # left open: the user's data
        own = OmegaConf.load(CONF / "experiment" / f"{name}.yaml")
        for group in ("train", "finetune", "objective", "cluster", "save"):
            for key, value in (own.get(group) or {}).items():
                if group == "cluster" and key == "device":
                    continue  # overridden above
                assert OmegaConf.select(cfg, f"{group}.{key}") == value, (name, group, key)
    assert compose(["experiment=llama3_1b_alpaca", "data.path=/d.json"]).train.seq_len == 2048


def test_a_users_config_dir_adds_presets(tmp_path):
    """`--config-dir` puts a user's folder on the search path: its presets sit beside ours."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /sharding: grad_op\n  - _self_\n"
        "train:\n  batch_size: 3\n")
    out = subprocess.run([warm.python(), "-m", "llama_fsdp", "--config-dir", str(tmp_path),
                          "experiment=mine", "cluster.device=cpu", "dry_run=true"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-2000:]
    assert "strategy                       grad_op" in log
    assert "micro_batch x grad_accum x dp  3 x 1 x 2 = 6" in log
    assert not (tmp_path / "outputs").exists()  # a dry run leaves nothing behind


def test_a_misspelled_dotted_override_names_the_key_and_the_closest_one():
    """Refused before Hydra, whose own message suggests `+train.batchsize`, which fails too."""
    import subprocess
    import sys

    out = subprocess.run([warm.python(), "-m", "llama_fsdp", "train.batchsize=2",
                          "sharding.shard_size=2", "model=8b", "hydra.run.dir=/tmp/never"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "train.batchsize is not a config key" in out.stderr
    assert "did you mean train.batch_size?" in out.stderr
    assert out.stderr.count("is not a config key") == 1  # sharding.shard_size is valid
    assert "+train.batchsize" not in out.stderr


def test_hybrid_with_one_shard_group_says_it_is_full_sharding(tmp_path):
    import subprocess
    import sys

    def dry(*overrides):
        out = subprocess.run([warm.python(), "-m", "llama_fsdp", "dry_run=true",
                              "cluster.device=cpu", f"hydra.run.dir={tmp_path}/run", *overrides],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout + out.stderr

    out = dry("sharding=hybrid")
    assert "sharding=hybrid with one shard group of all 2 ranks" in out
    assert "is sharding=full" in out
    assert "one shard group" not in dry("sharding=hybrid", "cluster.nproc_per_node=4",
                                        "sharding.shard_size=2")


def test_torchrun_layout_comes_from_the_environment_and_is_checked():
    """cluster=torchrun: nodes and ranks per node from torchrun's (or an operator's)
    environment; a config that says otherwise, a missing variable, an uneven world: refused."""
    from llama_fsdp.config.schema import ClusterConfig
    from llama_fsdp.launchers.torchrun import torchrun_layout

    base = {"RANK": "3", "WORLD_SIZE": "16", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}
    c = ClusterConfig(kind="torchrun", nodes=None, nproc_per_node=None)
    problems: list[str] = []
    assert torchrun_layout(c, problems, {**base, "LOCAL_WORLD_SIZE": "8",
                                         "GROUP_WORLD_SIZE": "2"}) == (2, 8)
    assert torchrun_layout(c, problems, base) == (16, 1)  # an operator's one process a pod
    assert problems == []
    torchrun_layout(ClusterConfig(kind="torchrun", nodes=4, nproc_per_node=8), problems,
                    {**base, "LOCAL_WORLD_SIZE": "8"})
    assert problems == ["cluster.nodes=4 but the launcher started 2 (from WORLD_SIZE=16, "
                        "LOCAL_WORLD_SIZE=8): drop cluster.nodes (cluster=torchrun reads it from "
                        "the environment) or launch 4"]
    problems.clear()
    torchrun_layout(c, problems, {**base, "WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "8"})
    assert problems and "not a whole number of nodes" in problems[0]
    problems.clear()
    torchrun_layout(c, problems, {"RANK": "0"})
    assert problems and "WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set here" in problems[0]


def test_the_cache_is_the_environment_s_where_it_names_one(tmp_path, monkeypatch):
    """cache_dir unset: $LLAMA_FSDP_CACHE_DIR where set (one cache for runs launched from
    several folders), else <launch dir>/outputs/cache; cache_dir given wins."""
    from llama_fsdp.config.rundir import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "shared"))
    assert make_spec([], output_dir=tmp_path / "a").cache_dir == str(tmp_path / "shared")
    assert make_spec([f"cache_dir={tmp_path}/mine"],
                     output_dir=tmp_path / "b").cache_dir == str(tmp_path / "mine")
    monkeypatch.delenv(CACHE_ENV)
    assert make_spec([], output_dir=tmp_path / "c").cache_dir == str(REPO / "outputs" / "cache")
