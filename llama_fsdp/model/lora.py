"""LoRA and QLoRA (finetune=lora | qlora) on a Llama built on the meta device.

Each target projection (an nn.Linear of a decoder layer named in finetune.target_modules)
becomes a ``LoRALinear``: the same frozen ``weight`` under the same name, so HF files, DCP and
init address it as before, beside ``lora_A`` (rank x in) and ``lora_B`` (out x rank, zero at
the start); qlora stores that weight as torchao's NF4Tensor (llama_fsdp/model/nf4.py). Adapters are
parameters like any other and share their base's FSDP unit. worker.build_model's order:

    build_meta_model -> apply_adapters (targets replaced, base frozen, NF4 shapes; on meta)
    -> parallel.parallelize (AC -> compile -> fully_shard; ``unsharded_nf4`` lists the NF4
       weights FSDP must leave alone) -> to_empty -> the base: HF rows
       (checkpoint.peft.load_hf_base) or ``init_base`` -> ``init_adapters``

The frozen base is kept in the compute dtype (``PrecisionPolicy.frozen_dtype``): no optimizer
reads it, so an fp32 master copy would be memory for nothing; adapters are in the param dtype.
Why our own module and not PEFT's: PEFT renames the base weight (``base_layer.weight``), so
HF loading, init and export would each need a key map, and its save_pretrained writes nothing
from a sharded model; PEFT stays the export format (checkpoint/peft.py writes it).
"""
from __future__ import annotations

import logging
import math
import zlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import nf4
from ..config.schema import FinetuneConfig
from .llama import decoder_layers, init_buffers, init_rows
from ..config.precision import PrecisionPolicy

log = logging.getLogger(__name__)

ADAPTER_KEYS = (".lora_A.", ".lora_B.")
# Wrappers that activation checkpointing and compile put into parameter names.
WRAPPERS = ("._checkpoint_wrapped_module", "._orig_mod")


class LoRALinear(nn.Module):
    """y = W x + (alpha / rank) * B(A(dropout(x))), W frozen (plain or NF4)."""

    def __init__(self, in_features: int, out_features: int, *, rank: int, alpha: float,
                 dropout: float, device: torch.device | str | None = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.scaling = alpha / rank
        # A Python flag, not isinstance on the weight: a constant under torch.compile.
        self.nf4 = False
        # The adapters off: the frozen base alone (DPO's reference: llama_fsdp/objective/dpo_reference.py).
        self.disabled = False
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device,
                                               dtype=dtype), requires_grad=False)
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nf4:  # dequantizes to x's dtype; saves only the (all-gathered) NF4 weight
            base = nf4.linear(x, self.weight)
        else:
            base = F.linear(x, self.weight)
        if self.disabled:
            return base
        return base + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, rank={self.rank}, "
                f"scaling={self.scaling:g}, nf4={self.nf4}")


def clean_name(name: str) -> str:
    """A parameter's name without the AC / compile wrappers: the HF name."""
    for w in WRAPPERS:
        name = name.replace(w, "")
    return name


def is_adapter(name: str) -> bool:
    return any(k in name for k in ADAPTER_KEYS)


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(clean name, module) of every LoRALinear."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield clean_name(name), module


def apply_adapters(model: nn.Module, ft: FinetuneConfig, *, policy: PrecisionPolicy) -> int:
    """Replace the target projections of every decoder layer by LoRALinear (on meta, before
    parallelize), freeze everything but the adapters, set the dtypes, and for qlora make the
    targets' weights NF4 (shapes only: filled per shard later). Returns the count replaced;
    0 for finetune=full (nothing changes)."""
    if not ft.adapters:
        return 0
    targets, replaced = set(ft.target_modules), 0
    for layer in decoder_layers(model):
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and name in targets:
                    assert child.bias is None, "Llama projections have no bias"
                    setattr(parent, name, LoRALinear(
                        child.in_features, child.out_features, rank=ft.rank, alpha=ft.alpha,
                        dropout=ft.dropout, device=child.weight.device))
                    replaced += 1
    if not replaced:
        raise ValueError(f"no projection named one of {sorted(targets)} in the model")
    frozen, trained = getattr(torch, policy.frozen_dtype), getattr(torch, policy.param_dtype)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
        p.data = p.data.to(trained if is_adapter(name) else frozen)
    if ft.nf4:
        for _, m in lora_modules(model):
            assert m.weight.is_meta, "NF4 shapes are made on meta, filled per shard later"
            m.weight = nn.Parameter(nf4.nf4_module().NF4Tensor.from_tensor(
                m.weight.detach(), ft.nf4_block_size, ft.nf4_scaler_block_size),
                requires_grad=False)
            m.nf4 = True
    return replaced


def unsharded_nf4(model: nn.Module, shard: int) -> set[nn.Parameter]:
    """The NF4 weights fully_shard must leave alone: all of them when the shard group is one
    rank (torch 2.13's FSDP2 skips the all-gather of a one-rank group and then unpacks NF4's
    three all-gather outputs as one: "expected 3, got 1"), none otherwise. Left alone, each
    rank holds the whole NF4 weight, which is what a one-rank shard is anyway."""
    if shard > 1:
        return set()
    return {m.weight for _, m in lora_modules(model) if m.nf4}


# --- this rank's values -------------------------------------------------------------------------


def local_rows(p: torch.Tensor) -> tuple[int, int]:
    """(first global row, number of rows) of this rank's part of ``p`` (FSDP2: dim-0 shards,
    replicated over other mesh dims); a plain tensor is all of its rows."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return 0, p.shape[0]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return offset[0], shape[0]


def shard_group(p: torch.Tensor) -> Optional[torch.distributed.ProcessGroup]:
    """The process group ``p``'s rows are split over (the mesh's shard dim), or None."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return None
    mesh = p.device_mesh
    return mesh.get_group(mesh.ndim - 1)  # (replicate, shard) or (shard,)


@torch.no_grad()
def set_nf4_rows(module: LoRALinear, rows: torch.Tensor, ft: FinetuneConfig) -> None:
    """Quantize this rank's rows of a target's base weight (the whole tensor's scaler mean,
    nf4.quantize_rows) and install the NF4 shard as the module's parameter. Installed through
    load_state_dict(assign=True) of a DTensor around it, as torchtune does: FSDP2's hook then
    registers it as the sharded parameter. The whole NF4Tensor is replaced, which also fixes
    what to_empty leaves behind (it moves only the three sharded inner tensors: the mean and
    the table would stay on meta)."""
    from torch.distributed.tensor import DTensor

    p = module.weight
    local = nf4.quantize_rows(rows.contiguous(), block_size=ft.nf4_block_size,
                              scaler_block_size=ft.nf4_scaler_block_size, group=shard_group(p))
    if isinstance(p, DTensor):
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        spec = DTensorSpec(mesh=p.device_mesh, placements=p.placements,
                           tensor_meta=TensorMeta(shape=p.size(), stride=p.stride(),
                                                  dtype=p.dtype))
        local = DTensor(local, spec, requires_grad=False)
    module.load_state_dict({"weight": nn.Parameter(local, requires_grad=False)}, strict=False,
                           assign=True)


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


@torch.no_grad()
def init_base(model: nn.Module, ft: FinetuneConfig, *, std: float, seed: int,
              device: torch.device) -> None:
    """model.init_weights's values for the frozen base, drawn shard-locally: parameter i of
    the base is the plain model's parameter i (the adapters are not counted, or they would
    shift every seed), so a LoRA model starts from the same weights as full fine-tuning.
    NF4 weights are drawn in their dtype and quantized per shard."""
    n_layers = model.config.num_hidden_layers
    owners = {f"{n}.weight": m for n, m in lora_modules(model) if m.nf4}
    base = [(clean_name(n), p) for n, p in model.named_parameters() if not is_adapter(n)]
    for index, (name, p) in enumerate(base):
        start, rows = local_rows(p)
        values = init_rows(name, tuple(p.shape), start, rows, index=index, std=std, seed=seed,
                           n_layers=n_layers)
        if name in owners:
            set_nf4_rows(owners[name], values.to(device, p.dtype), ft)
        else:
            local = _local(p)
            local.copy_(values.view(local.shape))
    init_buffers(model)


@torch.no_grad()
def init_adapters(model: nn.Module, *, seed: int) -> None:
    """A: kaiming-uniform(a=sqrt(5)) as PEFT and nn.Linear (U(-1/sqrt(in), 1/sqrt(in))), B: 0,
    so training starts from the base model exactly. A is drawn whole (rank x in, small) from a
    generator seeded by (seed, name) and sliced to this rank's rows: the same for any world
    size."""
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        local = _local(p)
        if ".lora_B." in name:
            local.zero_()
            continue
        start, rows = local_rows(p)
        bound = 1.0 / math.sqrt(p.shape[1])
        key = zlib.crc32(clean_name(name).encode())
        gen = torch.Generator().manual_seed(seed * 1_000_003 + key)
        full = torch.empty(tuple(p.shape)).uniform_(-bound, bound, generator=gen)
        local.copy_(full[start:start + rows])


def param_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of the whole model (not this rank's shards)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())
