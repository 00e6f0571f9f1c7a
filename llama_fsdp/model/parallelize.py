"""Parallelism applied to a model built elsewhere: mesh, activation checkpointing, compile, FSDP2
or DDP.

Order matters and follows torchtitan: activation checkpointing -> compile -> fully_shard on the
embedding, each decoder layer, [final norm, head], then the root (``apply_fsdp`` has the groups
and why; a tied embedding stays in the root). sharding=no_shard replicates with composable DDP
instead (``apply_ddp``). No model definitions here (see llama.py).
"""
from __future__ import annotations

import inspect
import logging
from typing import Optional

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from ..config.schema import CheckpointingConfig
from .offload import attach as attach_offload
from ..config.precision import DTYPE_BYTES, PrecisionPolicy
from ..config.strategies import DDP_BUCKET_MB, MeshSpec

log = logging.getLogger(__name__)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a precision policy names ("float32", "bfloat16", "float16")."""
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPE_BYTES)}")
    return getattr(torch, name)


def build_mesh(mesh: MeshSpec, device_type: str) -> DeviceMesh:
    """1-D ("shard",) or 2-D ("replicate", "shard") data-parallel mesh over all ranks."""
    return init_device_mesh(device_type, mesh.shape, mesh_dim_names=mesh.dim_names)


def apply_activation_checkpointing(layers: nn.ModuleList, ac: CheckpointingConfig, *,
                                   preserve_rng_state: bool = False) -> int:
    """Wrap decoder layers in non-reentrant checkpointing; return how many were wrapped.

    ``full`` wraps every layer (only each layer's input is kept); ``selective`` is layer-level:
    every ``every_k``-th layer is wrapped, trading memory for less recomputation. The RNG state
    is restored for the recomputation only where a layer draws random numbers (LoRA dropout:
    without it, eager recomputation draws another mask and the gradients are wrong).
    """
    chosen = ac.wrapped_layers(len(layers))
    for i in chosen:
        layers[i] = checkpoint_wrapper(layers[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                       preserve_rng_state=preserve_rng_state)
    return len(chosen)


def apply_compile(layers: nn.ModuleList) -> None:
    """torch.compile each decoder layer separately: small graphs, reused across layers."""
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer, dynamic=False)


def mixed_precision(policy: PrecisionPolicy) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=torch_dtype(policy.compute_dtype),
                                reduce_dtype=torch_dtype(policy.reduce_dtype))


def apply_fsdp(model: nn.Module, layers: nn.ModuleList, *, mesh: DeviceMesh,
               reshard_after_forward: bool, policy: PrecisionPolicy,
               cpu_offload: bool, ignored_params: Optional[set] = None) -> list[list[str]]:
    """fully_shard in torchtitan's groups: the embedding alone, every decoder layer, the final
    norm with the head, then the root (which then holds no parameters of its own).

    - The embedding's backward needs only the token ids, never the weight
      (``set_unshard_in_backward(False)``): it is all-gathered once per step, in forward, and
      its gradient is reduce-scattered at the end of backward.
    - The last layer and [norm, head] are not resharded after forward: backward needs them at
      once. The head is resharded after its own backward, its reduce-scatter overlaps the
      layers' backward, and nothing vocabulary-sized is held through the whole step. The price:
      the head stays gathered through the loss (one vocab x hidden tensor in the compute dtype
      at the loss-phase peak; benchmarks/cpu_runtime.md), instead of an all-gather that nothing
      overlaps when backward starts. plan.phase_peaks models both groupings.
    - A tied embedding (``tie_word_embeddings``, the 1B/3B shapes) is one parameter used at both
      ends: it cannot sit in two groups, so the embedding, norm and head stay in the root. The
      root is left at FSDP2's default, as torchtitan leaves it: not resharded after forward, so
      it is gathered once per step and held until its own backward, instead of being gathered
      a second time when the logits' grad arrives, before any other backward work can overlap
      it (a quarter less time per step: benchmarks/cpu_runtime.md). The price is the root held
      through backward (one vocab x hidden tensor in the compute dtype), which
      plan.phase_peaks counts.

    ``ignored_params`` stay out of FSDP, whole on every rank (adapters.unsharded_nf4).

    Returns the FSDP units (``fsdp_units``); raises if the grouping is not what was asked.
    """
    common = {"mesh": mesh, "mp_policy": mixed_precision(policy)}
    if ignored_params:
        common["ignored_params"] = ignored_params
    if cpu_offload:
        common["offload_policy"] = CPUOffloadPolicy()
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head.weight is embed.weight
    expected = len(layers) + 1
    if not tied:
        fully_shard(embed, reshard_after_forward=reshard_after_forward, **common)
        embed.set_unshard_in_backward(False)
        expected += 2
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        fully_shard(layer, reshard_after_forward=reshard_after_forward and not last, **common)
    if not tied:
        fully_shard([model.model.norm, head], reshard_after_forward=False, **common)
    # no reshard_after_forward: FSDP2 then keeps the root's parameters (a tied embedding, norm
    # and head; untied, none) gathered from forward to backward (torch >= 2.11)
    fully_shard(model, **common)
    units = fsdp_units(model)
    if len(units) != expected:
        raise RuntimeError(f"expected {expected} FSDP units, found {len(units)}: {units}")
    return units


def fsdp_units(model: nn.Module) -> list[list[str]]:
    """The FSDP units under ``model``, in module order, each as the names of the modules it was
    applied to (one unit for a group like [norm, lm_head]; "" is ``model`` itself)."""
    units: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            units.setdefault(id(module._get_fsdp_state()), []).append(name)
    return list(units.values())


def apply_ddp(model: nn.Module, *, policy: PrecisionPolicy, device_type: str) -> None:
    """sharding=no_shard: a full replica on every rank, gradients all-reduced in buckets that
    overlap backward (composable DDP over the default process group). The gradients live in the
    buckets (no second copy); buffers are not re-broadcast every forward (every rank computes the
    same rotary tables). DDP is built at the first forward, so it sees the materialized weights
    and starts every rank from rank 0's. With precision=mixed the forward runs under autocast in
    the compute dtype (fp32 parameters, gradients and all-reduce), where FSDP2 casts the
    gathered parameters instead.
    """
    from torch.distributed._composable.replicate import replicate
    from torch.nn.parallel import DistributedDataParallel

    # torch 2.13 renamed broadcast_buffers to forward_sync_buffers (2.11 has only the old name)
    buffers = ("forward_sync_buffers" if "forward_sync_buffers" in
               inspect.signature(DistributedDataParallel.__init__).parameters
               else "broadcast_buffers")
    # With a frozen base (adapters) DDP does not broadcast rank 0's weights at the start: its
    # broadcast copies into every parameter, and a copy into an NF4 weight re-quantizes it
    # (changing it); every rank built the same weights anyway (seeded init, the same files).
    frozen = any(not p.requires_grad for p in model.parameters())
    replicate(model, bucket_cap_mb=DDP_BUCKET_MB, gradient_as_bucket_view=True,
              **{buffers: False}, **({"init_sync": False} if frozen else {}))
    if policy.compute_dtype != policy.param_dtype:
        model.forward = torch.autocast(device_type, dtype=torch_dtype(policy.compute_dtype))(
            model.forward)


def uses_ddp(model: nn.Module) -> bool:
    """Whether ``apply_ddp`` replicated this model (gradient sync can then wait for the last
    micro-batch at no memory cost; FSDP would keep unsharded gradients instead)."""
    from torch.distributed._composable.contract import _get_registry

    return "replicate" in (_get_registry(model) or {})


def parallelize(model: nn.Module, layers: nn.ModuleList, *, mesh: DeviceMesh, mesh_spec: MeshSpec,
                policy: PrecisionPolicy, ac: CheckpointingConfig, compile: bool,
                cpu_offload: bool, ignored_params: Optional[set] = None,
                preserve_rng_state: bool = False) -> nn.Module:
    """AC -> compile -> FSDP (or DDP for no_shard) -> activation offload (checkpointing.offload:
    hooks on the outermost layer modules), in place; the model may still be on the meta device.
    ``ignored_params`` (FSDP only) and ``preserve_rng_state`` (AC): the adapters' needs
    (lora.py)."""
    wrapped = apply_activation_checkpointing(layers, ac, preserve_rng_state=preserve_rng_state)
    if compile:
        apply_compile(layers)
    if mesh_spec.ddp:
        apply_ddp(model, policy=policy, device_type=mesh.device_type)
        how = f"DDP over {mesh.size()} rank(s), buckets of {DDP_BUCKET_MB} MB"
    else:
        units = apply_fsdp(model, layers, mesh=mesh,
                           reshard_after_forward=mesh_spec.reshard_after_forward, policy=policy,
                           cpu_offload=cpu_offload, ignored_params=ignored_params)
        groups = ("the root with the tied embedding, norm and head"
                  if len(units) == len(layers) + 1
                  else "the embedding, [norm, head], an empty root")
        how = (f"{len(units)} FSDP units on mesh {dict(zip(mesh_spec.dim_names, mesh_spec.shape))} "
               f"({len(layers)} layers, {groups})")
    offloaded = attach_offload(layers, ac, device_type=mesh.device_type)
    log.info("parallelized: %s, %d layer(s) checkpointed%s, compile=%s", how, wrapped,
             " (their inputs offloaded to host memory)" if offloaded else "", compile)
    return model


def local_numel(model: nn.Module) -> int:
    """Parameter elements this rank holds (its shards)."""
    return sum(_local(p).numel() for p in model.parameters())


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 gradient norm over all shards; clip to max_norm when max_norm > 0.

    Works on the local shards: one ``_foreach_norm`` per group of gradients that share a mesh
    and placements, the squared sum all-reduced over the mesh dims the gradient is sharded on
    (a replicated dim holds the same values and is not summed), one in-place ``_foreach_mul_``
    to clip. ``torch.nn.utils.clip_grad_norm_`` gives the same numbers on DTensor gradients at
    twice the cost (it dispatches every per-tensor op through DTensor;
    benchmarks/cpu_runtime.md). Returns a 0-d fp32 tensor on the gradients' device (no host
    sync).
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if any(isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements) for g in grads):
        return _clip_grad_norm_dtensor(params, grads, max_norm)  # not FSDP's layout: exact path
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        dt = isinstance(g, DTensor)
        sharded = tuple(i for i, pl in enumerate(g.placements) if pl.is_shard()) if dt else ()
        groups.setdefault((g.device_mesh if dt else None, sharded, g.device), []).append(_local(g))
    device = grads[0].device
    total_sq = torch.zeros((), device=device, dtype=torch.float32)
    for (mesh, sharded, _), local in groups.items():
        sq = torch.stack(torch._foreach_norm(local, 2.0)).float().square().sum()
        for dim in sharded:
            torch.distributed.all_reduce(sq, group=mesh.get_group(dim))
        total_sq += sq.to(device)
    total = total_sq.sqrt()
    if max_norm > 0:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # as clip_grads_with_norm_
        for (_, _, dev), local in groups.items():
            torch._foreach_mul_(local, coef.to(dev))
    return total


def _clip_grad_norm_dtensor(params: list[nn.Parameter], grads: list[torch.Tensor],
                            max_norm: float) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # reduce the partial norms across the mesh
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
