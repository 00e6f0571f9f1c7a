"""Checkpoint pieces that need no process group: spec-time checks of model.path, checkpoint
selection and retention, RNG state, the weights-only loader, and the one-process converter."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import LlamaConfig, LlamaForCausalLM

from llama_fsdp.run import checks
from llama_fsdp.checkpoint import hf, layout
from llama_fsdp.checkpoint import dcp as ckpt_dcp
from llama_fsdp.config import hf_dir
from llama_fsdp.checkpoint.convert import main as convert_main
from llama_fsdp.config.rundir import HF_META
from llama_fsdp.model.llama import llama_config
from llama_fsdp.run.spec import ConfigError
from tests.conftest import compose, make_spec


def _hf_dir(path: Path, cfg: LlamaConfig, *, weights: bool = True) -> Path:
    """config.json (+ a token safetensors file: the shape check reads only the config)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    cfg.to_json_file(str(path / "config.json"))
    if weights:
        save_file({"x": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


def _model_cfg(name: str):
    from omegaconf import OmegaConf

    return OmegaConf.to_object(compose([f"model={name}", "output_dir=/tmp/x"])).model  # type: ignore[union-attr]


# --- model.path at spec time ---------------------------------------------------------------------

def test_a_named_shape_that_disagrees_with_the_folder_names_fields_and_the_preset(tmp_path):
    hf = _hf_dir(tmp_path / "llama-3.2-1b", llama_config(_model_cfg("1b")))
    with pytest.raises(ConfigError) as e:
        make_spec(["model=3b", f"model.path={hf}", "cluster.device=cpu"])
    msg = str(e.value)
    assert "model=3b does not match model.path" in msg
    assert "hidden_size: model.hidden_size=3072 but config.json has 2048" in msg
    assert "num_layers: model.num_layers=28 but config.json has 16" in msg
    assert "use model=1b" in msg and "model=1b model." not in msg  # the preset matches exactly
    make_spec(["model=1b", f"model.path={hf}", "cluster.device=cpu"])  # and then it builds


def test_model_path_numeric_difference_suggests_overrides(tmp_path):
    cfg = llama_config(_model_cfg("1b"))
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    hf = _hf_dir(tmp_path / "hf", cfg)
    with pytest.raises(ConfigError, match=r"rope_theta: model.rope_theta=500000.0 but config.json "
                                          r"has 10000.0.*use model=1b model.rope_theta=10000.0"):
        make_spec(["model=1b", f"model.path={hf}", "cluster.device=cpu"])


def test_model_path_matching_shape_builds(tmp_path):
    hf = _hf_dir(tmp_path / "hf", llama_config(_model_cfg("tiny")))
    assert make_spec([f"model.path={hf}"]).model.path == str(hf)


def test_model_path_problems_without_config_or_safetensors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    no_weights = _hf_dir(tmp_path / "bin_only", llama_config(_model_cfg("tiny")), weights=False)
    with pytest.raises(ConfigError) as e:
        make_spec([f"model.path={empty}"])
    assert "has no config.json" in str(e.value)
    with pytest.raises(ConfigError) as e:
        make_spec([f"model.path={no_weights}"])
    assert "no *.safetensors" in str(e.value)
    with pytest.raises(ConfigError, match="neither a directory nor a hub name"):
        make_spec([f"model.path={tmp_path}/missing/dir"])


def test_hf_shape_reads_old_and_new_rope_keys():
    old = {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
           "intermediate_size": 16, "vocab_size": 32, "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    shape = hf_dir.hf_shape(old)
    assert shape["num_kv_heads"] == 2 and shape["rope_theta"] == 500000.0
    assert shape["rope_scaling"]["factor"] == 8.0 and shape["tie_word_embeddings"] is False
    new = {**old, "rope_scaling": None,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert hf_dir.hf_shape(new)["rope_scaling"] is None and hf_dir.hf_shape(new)["rope_theta"] == 10000.0


def test_save_and_stop_options_are_checked():
    with pytest.raises(ConfigError) as e:
        make_spec(["save.async_save=true", "save.full_state_dict=true", "train.stop_after=99"])
    msg = str(e.value)
    assert "save.async_save=true with save.full_state_dict=true" in msg
    assert "train.stop_after=99 must be in [1, train.max_steps=60]" in msg


# --- checkpoint directories ----------------------------------------------------------------------

def _fake(run: Path, name: str, complete: bool = True) -> Path:
    d = run / layout.CHECKPOINTS / name
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x")
    if complete:
        (d / layout.METADATA).write_bytes(b"m")
    return d


def test_only_published_complete_checkpoints_count(tmp_path):
    run = tmp_path / "run"
    s2, s4 = _fake(run, "step_000002"), _fake(run, "step_000004")
    _fake(run, "step_000006", complete=False)  # published without metadata: never happens, skip
    tmp8 = _fake(run, "step_000008.tmp")  # an interrupted save, even with metadata
    _fake(run, "notes")
    assert layout.list_checkpoints(run) == [(2, s2), (4, s4)]
    assert layout.resolve_resume("auto", run) == s4
    assert layout.resolve_resume("none", run) is None
    assert layout.resolve_resume(str(run), tmp_path / "other") == s4  # a run dir: its newest
    assert layout.resolve_resume(str(s2), tmp_path / "other") == s2
    assert layout.resolve_resume("auto", tmp_path / "fresh") is None
    with pytest.raises(FileNotFoundError):
        layout.resolve_resume(str(tmp_path), run)
    assert layout.expired(run, keep_last=1) == [s2] and layout.expired(run, keep_last=2) == []
    assert layout.interrupted(run) == [tmp8]


def test_removal_refuses_paths_outside_the_checkpoints_folder(tmp_path):
    outside = tmp_path / "precious"
    outside.mkdir()
    with pytest.raises(RuntimeError, match="refusing to delete"):
        layout._remove(outside, tmp_path / "run" / layout.CHECKPOINTS)
    assert outside.exists()


def test_resume_path_that_is_not_a_checkpoint_fails_at_spec_time(tmp_path):
    with pytest.raises(ConfigError, match="neither a DCP checkpoint"):
        make_spec([f"resume={tmp_path}"])


# --- state ---------------------------------------------------------------------------------------

def test_rng_state_round_trips_through_weights_only_load():
    import io

    import numpy as np

    state = ckpt_dcp.rng_state()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)  # what DCP's bytes become on load
    draws = (torch.rand(3), random.random(), np.random.rand())
    ckpt_dcp.set_rng_state(state)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(draws[0], again[0]) and draws[1:] == again[1:]


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo unpickled > /dev/null",))


def test_non_tensor_state_is_loaded_weights_only(tmp_path):
    dcp.save({"x": _Evil(), "t": torch.ones(2)}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    with pytest.raises(dcp.CheckpointException, match="unsupported GLOBAL posix.system"):
        dcp.load({"x": 0, "t": torch.zeros(2)}, checkpoint_id=str(tmp_path / "c"), no_dist=True,
                 planner=ckpt_dcp._WeightsOnlyLoadPlanner())


# --- the one-process converter -------------------------------------------------------------------

TINY = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


def _dcp_checkpoint(path: Path, *, tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig.from_dict({**TINY.to_dict(), "tie_word_embeddings": tied})
    model = LlamaForCausalLM(cfg).eval()
    state = {"model": model.state_dict(), "train": {"step": 3, "tokens_seen": 10}}
    dcp.save({"app": state}, checkpoint_id=str(path), no_dist=True)
    hf.write_hf_meta(path / HF_META, cfg)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_convert_writes_what_from_pretrained_loads(tmp_path, tied):
    model = _dcp_checkpoint(tmp_path / "run" / layout.CHECKPOINTS / "step_000003", tied=tied)
    out = tmp_path / "hf"
    assert convert_main([str(tmp_path / "run"), str(out), "--max-shard-size", "20KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, with an index
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    loaded = LlamaForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=0, atol=0)


def test_convert_casts_and_takes_the_config_from_a_run_yaml(tmp_path):
    ckpt = tmp_path / "run" / layout.CHECKPOINTS / "step_000003"
    model = _dcp_checkpoint(ckpt)
    (ckpt / HF_META / "config.json").unlink()
    yaml = tmp_path / "config.yaml"
    yaml.write_text("model:\n  name: t\n  hidden_size: 32\n  num_layers: 2\n  num_heads: 4\n"
                    "  num_kv_heads: 2\n  intermediate_size: 64\n  vocab_size: 96\n"
                    "  rope_theta: 10000.0\n  rms_norm_eps: 1.0e-06\n")
    out = tmp_path / "hf"
    assert convert_main([str(ckpt), str(out), "--config", str(yaml), "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = LlamaForCausalLM.from_pretrained(out)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight.bfloat16())
    assert convert_main([str(tmp_path / "nothing"), str(tmp_path / "o2")]) == 2


def test_convert_never_replaces_an_existing_directory_unless_asked(tmp_path):
    _dcp_checkpoint(tmp_path / "run" / layout.CHECKPOINTS / "step_000003")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "precious.txt").write_text("user data")
    assert convert_main([str(tmp_path / "run"), str(out)]) == 2
    assert (out / "precious.txt").read_text() == "user data"
    assert convert_main([str(tmp_path / "run"), str(out), "--overwrite"]) == 0
    assert (out / "config.json").exists() and not (out / "precious.txt").exists()


# --- hub names -----------------------------------------------------------------------------------

def test_hub_names_go_through_the_hub_client(tmp_path, monkeypatch):
    """model.path=org/name is read with hf_hub_download / snapshot_download; tests have no
    network, so the client serves a pre-filled cache in offline mode."""
    from huggingface_hub import constants

    from llama_fsdp.config.schema import ModelConfig

    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--test-org--tiny-llama"
    torch.manual_seed(0)
    source = LlamaForCausalLM(TINY)
    source.save_pretrained(repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    m = ModelConfig(name="t", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=64, vocab_size=96, rope_theta=10000.0, rms_norm_eps=1e-6,
                    path="test-org/tiny-llama")
    assert checks.model_path_problems(m) == []
    assert "hub lookup of its config.json failed" in checks.model_path_problems(
        ModelConfig(**{**m.__dict__, "path": "test-org/absent"}))[0]
    assert hf_dir.resolve_hf_dir("test-org/tiny-llama") == repo / "snapshots" / rev
    # an export names its base by the hub name, not this machine's snapshot path
    assert hf_dir.hub_name(str(repo / "snapshots" / rev)) == "test-org/tiny-llama"
    assert hf_dir.hub_name("/models/Llama-3.2-1B") == "/models/Llama-3.2-1B"
    torch.manual_seed(1)
    target = LlamaForCausalLM(TINY)
    hf.load_hf_weights(target, "test-org/tiny-llama")  # one process, no process group
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(),
                                                 source.state_dict().values()))


@pytest.mark.parametrize("dtype,tied", [(torch.bfloat16, False), (torch.float32, True)])
def test_hf_weights_load_across_dtypes_and_with_tied_embeddings(tmp_path, dtype, tied):
    cfg = LlamaConfig.from_dict({**TINY.to_dict(), "tie_word_embeddings": tied})
    torch.manual_seed(0)
    source = LlamaForCausalLM(cfg).to(dtype)
    source.save_pretrained(tmp_path / "hf")
    torch.manual_seed(1)
    target = LlamaForCausalLM(cfg)  # fp32
    hf.load_hf_weights(target, str(tmp_path / "hf"))
    for (name, a), b in zip(target.state_dict().items(), source.state_dict().values()):
        assert a.dtype == torch.float32 and torch.equal(a, b.float()), name
    assert (target.lm_head.weight is target.model.embed_tokens.weight) is tied


# --- a crafted checkpoint ------------------------------------------------------------------------

class _Touch:
    """Unpickled, creates a file: what a crafted .metadata can do with torch's own reader."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch '{self.path}'",))


def crafted_checkpoint(ckpt: Path, marker: Path) -> Path:
    """A real DCP checkpoint whose .metadata also carries a payload that runs on unpickling
    (the Metadata object is DCP's own; only its planner_data is replaced)."""
    import pickle

    _dcp_checkpoint(ckpt)
    md = dcp.FileSystemReader(str(ckpt)).read_metadata()
    md.planner_data = _Touch(marker)
    (ckpt / layout.METADATA).write_bytes(pickle.dumps(md))
    return ckpt


def test_a_crafted_checkpoint_is_refused_by_convert_and_resume_and_runs_nothing(tmp_path, caplog):
    """Before: torch's FileSystemReader unpickled .metadata with no restriction: convert (and
    resume=) ran the payload."""
    marker = tmp_path / "marker"
    ckpt = crafted_checkpoint(tmp_path / "run" / layout.CHECKPOINTS / "step_000003", marker)
    meta = ckpt / layout.METADATA
    assert convert_main([str(ckpt), str(tmp_path / "hf")]) == 2
    assert f"{meta} is not a checkpoint llama_fsdp will read: unpickling it would load " \
           "posix.system" in caplog.text
    with pytest.raises(ConfigError, match="would load posix.system"):
        make_spec([f"resume={ckpt}"], output_dir=tmp_path / "new")
    with pytest.raises(ConfigError, match="would load posix.system"):
        make_spec(["resume=auto"], output_dir=tmp_path / "run")  # resume=auto finds it too
    from llama_fsdp.checkpoint.pickles import UnsafeCheckpoint

    with pytest.raises(UnsafeCheckpoint):  # what the ranks read it with (dcp.load included)
        ckpt_dcp.SafeReader(str(ckpt)).read_metadata()
    assert not marker.exists() and not (tmp_path / "hf").exists()
    import pickle

    pickle.loads(meta.read_bytes())  # the payload is real: torch's reader would have run it
    assert marker.exists()


def test_dcps_own_metadata_reads_as_dcp_wrote_it(tmp_path):
    """What torch (2.11 and 2.13) writes passes: tensors, bytes, paths, dtypes, layouts."""
    from llama_fsdp.checkpoint.pickles import load_metadata

    ckpt = tmp_path / "c"
    _dcp_checkpoint(ckpt)
    dcp.save({"extra": {"b": torch.ones(2, dtype=torch.bfloat16), "i": 3, "s": {"x": [1]}}},
             checkpoint_id=ckpt / "more", no_dist=True)  # a Path as the checkpoint id
    for path in (ckpt, ckpt / "more"):
        ours = load_metadata(path / layout.METADATA)
        theirs = dcp.FileSystemReader(str(path)).read_metadata()
        assert ours.state_dict_metadata == theirs.state_dict_metadata
        assert ours.storage_data == theirs.storage_data


def test_a_damaged_metadata_is_left_to_resumes_fallback_not_called_hostile(tmp_path):
    """A truncated .metadata is damaged, not crafted: the check before launch lets the ranks
    skip it for the checkpoint before (what resume=auto does with any damaged one)."""
    from llama_fsdp.checkpoint.pickles import DamagedCheckpoint, check_file, load_metadata

    ckpt = tmp_path / "c"
    _dcp_checkpoint(ckpt)
    meta = ckpt / layout.METADATA
    meta.write_bytes(meta.read_bytes()[:100])
    assert check_file(meta) is None
    with pytest.raises(DamagedCheckpoint, match="is not a readable pickle"):
        load_metadata(meta)


def test_a_full_disk_is_named_as_one_with_the_paths_own_case(tmp_path):
    """Before (issue 63): the hint went through str.capitalize(), which lower-cases the rest
    (/Data/Run -> /data/run), and torch's 'unexpected pos' (a short write of a full disk) got
    the 'check that it is writable' hint."""
    import errno

    from llama_fsdp.checkpoint.dcp import save_hint

    root = tmp_path / "Data" / "MyRun" / "checkpoints"
    short = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1856 vs "
                         "1746")
    for err in (short, OSError(errno.ENOSPC, "No space left on device")):
        assert save_hint(root, err) == (f"The disk looks full: free space on {root} (df -h "
                                        f"{root}) or point output_dir elsewhere")
    assert save_hint(root, PermissionError(errno.EACCES, "Permission denied")) == \
        f"Check that {root} is writable"
