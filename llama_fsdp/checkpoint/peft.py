"""A LoRA / QLoRA model's weights in and out (llama_fsdp/model/lora.py has the modules).

In: the frozen base from an HF directory, each rank reading only its rows. Plain weights go
straight into their shards (DCP's HuggingFaceStorageReader, as hf.load_hf_weights); NF4
weights are read one decoder layer at a time into 16-bit staging shards, quantized per shard
with the whole tensor's scaler mean, and installed, so no rank ever holds more than one
layer's rows in 16 bits.

Out: the PEFT adapter directory (adapter_config.json + adapter_model.safetensors, keys
``base_model.model.<our name>``) that ``peft.PeftModel.from_pretrained(base, dir)`` loads, and
optionally the merged HF model (W + alpha / rank * B A, over the dequantized base for qlora)
that ``from_pretrained`` loads. Both are collective: every rank gathers, rank 0 writes.
"""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.tensor import DTensor

from ..model import nf4
from ..model.lora import LoRALinear, clean_name, is_adapter, lora_modules, set_nf4_rows
from ..config.schema import FinetuneConfig
from ..model.llama import init_buffers
from ..config.hf_dir import resolve_hf_dir
from .hf import _unique_state, save_safetensors, write_hf_dir
from .layout import dir_bytes, publish_dir, scratch_dir

log = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."  # PEFT's key of our parameter <name>: PEFT_PREFIX + name
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
LAYER = re.compile(r"^(.*\.layers\.\d+)\.")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@torch.no_grad()
def load_hf_base(model: nn.Module, path: str, ft: FinetuneConfig, *,
                 device: torch.device) -> dict[str, float]:
    """The frozen base from HF safetensors, every rank reading only its rows (module doc).
    Returns the load time and the largest 16-bit staging this rank held (one layer's rows)."""
    t0 = time.perf_counter()
    hf_dir = str(resolve_hf_dir(path))
    reader = lambda: dcp.HuggingFaceStorageReader(hf_dir)  # noqa: E731 - one per load
    owners = {f"{n}.weight": m for n, m in lora_modules(model) if m.nf4}
    plain = _unique_state({clean_name(n): p.detach() for n, p in model.named_parameters()
                           if not is_adapter(n) and clean_name(n) not in owners})
    if plain:
        dcp.load(plain, storage_reader=reader(), planner=DefaultLoadPlanner())
    layers: dict[str, list[str]] = {}
    for name in owners:
        layers.setdefault(LAYER.match(name).group(1), []).append(name)  # type: ignore[union-attr]
    staged = 0
    for names in layers.values():
        rows = {n: _staging(owners[n].weight, device) for n in names}
        staged = max(staged, sum(_local_bytes(t) for t in rows.values()))
        dcp.load(rows, storage_reader=reader(), planner=DefaultLoadPlanner())
        for n in names:
            t = rows[n]
            set_nf4_rows(owners[n], t.to_local() if isinstance(t, DTensor) else t, ft)
        del rows, t  # t too: the layer's last rows would stay alive into the next layer's read
    init_buffers(model)
    dt = time.perf_counter() - t0
    log.info("loaded the base from %s in %.2fs (%d NF4 weights quantized per shard)", hf_dir,
             dt, len(owners))
    return {"load_hf_s": dt, "staging_bytes": float(staged)}


def _staging(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An empty 16-bit tensor shaped and sharded as the NF4 parameter ``p``, for DCP to read
    this rank's rows into."""
    from ..model.lora import local_rows

    _, rows = local_rows(p)
    buf = torch.empty(rows, p.shape[1], dtype=p.dtype, device=device)
    if not isinstance(p, DTensor):
        return buf
    return DTensor.from_local(buf, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


# --- out -----------------------------------------------------------------------------------------


@torch.no_grad()
def gather(p: torch.Tensor, *, dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    """The full value of a (sharded, possibly NF4) parameter on rank 0's CPU, None elsewhere.
    Collective. NF4 shards are dequantized locally first: valid because every shard was
    quantized with the whole tensor's scaler mean."""
    local = p.to_local() if isinstance(p, DTensor) else p
    if nf4.is_nf4(local):
        local = local.get_original_weight()
    if dtype is not None:
        local = local.to(dtype)
    full = (DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                               shape=p.shape, stride=p.stride()).full_tensor()
            if isinstance(p, DTensor) else local)
    return full.detach().to("cpu", copy=True) if _rank() == 0 else None


def peft_config(ft: FinetuneConfig, base_model: Optional[str]) -> dict[str, Any]:
    """adapter_config.json: what peft.LoraConfig reads (its defaults for the rest), so that
    PEFT is needed only by whoever loads the adapter."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": ft.rank,
            "lora_alpha": ft.alpha, "lora_dropout": ft.dropout,
            "target_modules": sorted(ft.target_modules), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "base_model_name_or_path": base_model}


def export_adapter(model: nn.Module, out: Path, *, ft: FinetuneConfig,
                   base_model: Optional[str], tokenizer: Any = None) -> Optional[Path]:
    """The PEFT adapter directory (module doc), written beside ``out`` and renamed into place
    by rank 0, which returns its path (others: None). Collective."""
    t0 = time.perf_counter()
    sd = {}
    for name, p in model.named_parameters():
        if is_adapter(name):
            full = gather(p)
            if full is not None:
                sd[PEFT_PREFIX + clean_name(name)] = full.contiguous()
    path = None
    if _rank() == 0:
        tmp = scratch_dir(Path(out))
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config(ft, base_model), indent=2,
                                                     sort_keys=True) + "\n")
        save_safetensors(sd, tmp / ADAPTER_WEIGHTS)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(str(tmp))
        path = publish_dir(tmp, Path(out))
        log.info("exported the adapter to %s (%d tensors, %.2f MB) in %.2fs", path, len(sd),
                 dir_bytes(path) / 1e6, time.perf_counter() - t0)
    if dist.is_initialized():
        dist.barrier()
    return path


@torch.no_grad()
def export_merged(model: nn.Module, out: Path, *, config: Any, dtype: torch.dtype,
                  tokenizer: Any = None) -> Optional[Path]:
    """The base with every adapter merged in (W + alpha / rank * B A, in fp32, then ``dtype``)
    as an HF directory on rank 0. Collective; tensors are gathered one at a time."""
    t0 = time.perf_counter()
    owners: dict[str, LoRALinear] = {f"{n}.weight": m for n, m in lora_modules(model)}
    sd = {}
    for name, p in model.named_parameters():
        name = clean_name(name)
        if is_adapter(name):
            continue
        w = gather(p, dtype=torch.float32)
        if name in owners:
            m = owners[name]
            a = gather(m.lora_A.weight, dtype=torch.float32)
            b = gather(m.lora_B.weight, dtype=torch.float32)
            if w is not None:
                w = w + m.scaling * (b @ a)
        if w is not None:
            sd[name] = w.to(dtype)
    path = None
    if _rank() == 0:
        path = write_hf_dir(sd, Path(out), config=config, tokenizer=tokenizer)
        log.info("exported the merged model to %s (%.1f MB) in %.2fs", path,
                 dir_bytes(path) / 1e6, time.perf_counter() - t0)
    if dist.is_initialized():
        dist.barrier()
    return path
