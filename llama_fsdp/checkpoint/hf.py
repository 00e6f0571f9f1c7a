"""Hugging Face directories in and out: per-shard loading into a sharded model, and the
consolidated export that ``from_pretrained`` reads.

A sharded model reads an HF directory through DCP's ``HuggingFaceStorageReader``: each rank
asks only for the rows its FSDP2 shards hold and the reader copies
``safe_open(...).get_slice(name)[rows]`` into them, so no rank ever holds a full model (or even
a full tensor). Weights outside DCP are safetensors.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from ..config.schema import ModelConfig
from ..config.hf_dir import REMOTE_CODE_KEYS, resolve_hf_dir
from .layout import dir_bytes, publish_dir, scratch_dir

log = logging.getLogger(__name__)

MAX_SHARD_BYTES = 5 * 1024**3  # export shards, as transformers' save_pretrained


def _unique_state(sd: dict[str, Any]) -> dict[str, Any]:
    """Drop aliases (a tied lm_head is the embedding): HF files hold the tensor once."""
    from torch.distributed.tensor import DTensor

    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = {}
    for k, v in sd.items():
        local = v.to_local() if isinstance(v, DTensor) else v
        key = (local.data_ptr(), tuple(v.shape))
        if local.numel() and key in seen:
            continue
        seen.add(key)
        out[k] = v
    return out


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str) -> dict[str, float]:
    """Fill a sharded (or plain) model from HF safetensors; every rank reads only its rows.

    DCP plans one read per local shard and ``HuggingFaceStorageReader`` serves it with
    ``get_slice``, so a rank's memory grows by its shards (which it had to hold anyway), not by
    the model. Any dtype on disk converts on copy. A tensor the model needs and the files lack
    is an error; extra tensors in the files are ignored.
    """
    t0 = time.perf_counter()
    hf_dir = resolve_hf_dir(path)
    sd = _unique_state(get_model_state_dict(model))
    dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(str(hf_dir)),
             planner=DefaultLoadPlanner(allow_partial_load=False))
    set_model_state_dict(model, sd, options=StateDictOptions(strict=False))
    dt = time.perf_counter() - t0
    log.info("loaded %d tensors from %s in %.2fs", len(sd), hf_dir, dt)
    return {"load_hf_s": dt}



def hf_config(m: ModelConfig, *, dtype: str, tokenizer: Any = None) -> Any:
    """The config.json of an export: the source model's when it came from model.path, else the
    group's shape; with the dtype saved and the tokenizer's special token ids."""
    from transformers import LlamaConfig

    from ..model.llama import llama_config, read_hf_config

    source = {k: v for k, v in read_hf_config(m.path).items() if k not in REMOTE_CODE_KEYS} \
        if m.path else None  # (an export never names code to run: hf_dir.REMOTE_CODE_KEYS)
    cfg = LlamaConfig.from_dict(source) if source is not None else llama_config(m)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = dtype
    cfg.use_cache = True
    if tokenizer is not None:
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(tokenizer, attr, None)
            if value is not None:
                setattr(cfg, attr, value)
    return cfg


def write_hf_meta(out: Path, config: Any, tokenizer: Any = None) -> None:
    """config.json (and the tokenizer's files) of an HF directory."""
    out.mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(out / "config.json"), use_diff=False)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(out))


def write_hf_weights(sd: dict[str, torch.Tensor], out: Path, *,
                     max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """safetensors files in save_pretrained's layout: model.safetensors, or numbered shards
    plus model.safetensors.index.json. Returns the file names."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in sd.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v.detach().contiguous()
        size += n
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
                 "weight_map": {k: name for name, s in zip(names, shards) for k in s}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for name, s in zip(names, shards):
        save_safetensors(s, out / name)
    return names


def save_safetensors(sd: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file, readable as save_pretrained's are (save_file creates 0600)."""
    from safetensors.torch import save_file

    umask = os.umask(0o22)
    os.umask(umask)
    save_file(sd, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~umask)


def write_hf_dir(sd: dict[str, torch.Tensor], out: Path, *, config: Any = None,
                 meta_dir: Optional[Path] = None, tokenizer: Any = None,
                 max_shard_bytes: int = MAX_SHARD_BYTES, overwrite: bool = False) -> Path:
    """A complete HF directory, written beside ``out`` and renamed into place at the end.

    config.json and tokenizer files come from ``config`` / ``tokenizer``, or are copied from
    ``meta_dir`` (a checkpoint's ``hf/`` folder), so an export and a conversion of the same
    weights give the same files. An existing ``out`` is replaced only when it is an earlier
    export of llama_fsdp's or ``overwrite`` (layout.publish_dir); else ExportExists.
    """
    out = Path(out)
    tmp = scratch_dir(out)
    if meta_dir is not None:
        for f in sorted(meta_dir.iterdir()):
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)
    else:
        write_hf_meta(tmp, config, tokenizer)
    tied = json.loads((tmp / "config.json").read_text()).get("tie_word_embeddings", False)
    if tied:  # the head is the embedding: HF files hold it once
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    write_hf_weights(sd, tmp, max_shard_bytes=max_shard_bytes)
    return publish_dir(tmp, out, overwrite=overwrite)


def export_hf(model: nn.Module, out: Path, *, config: Any, tokenizer: Any = None) -> Optional[Path]:
    """Gather the full model to rank 0 (CPU, one tensor at a time) and write an HF directory.

    Collective: every rank calls it; rank 0 writes and returns the path, others return None.
    """
    t0 = time.perf_counter()
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                              cpu_offload=True))
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = None
    if rank == 0:
        path = write_hf_dir(sd, out, config=config, tokenizer=tokenizer)
        log.info("exported %s (%.1f MB) in %.2fs", path, dir_bytes(path) / 1e6,
                 time.perf_counter() - t0)
    if dist.is_initialized():
        dist.barrier()
    return path

