"""Attention over packed rows: the records' boundaries as cumulative lengths, not a dense mask.

``model.attn_implementation`` picks the kernel:

- ``sdpa``: transformers' SDPA. Packed rows (position_ids restarting at every record) make
  transformers build a dense b x 1 x s x s block-causal mask every forward: SDPA then cannot use
  its flash kernel on CUDA, the mask (and k/v repeated to every head) is saved for backward
  (memory in b·s², see plan.packed_mask_bytes), and transformers checks the packed mask with a
  host sync every forward (``masking_utils.find_packed_sequence_indices``).
- ``varlen`` (this module): ``torch.nn.attention.varlen.varlen_attn`` (flash attention, CUDA,
  16-bit compute) over the flattened tokens, with each record as its own sequence. The
  boundaries are computed on the host from the CPU position_ids before the batch moves to the
  device (``model_inputs``): no mask, no host sync, no k/v repetition where the kernel takes
  grouped-query heads. On other devices the same function runs a reference (SDPA with the block
  mask rebuilt from the boundaries): exact, and as slow as ``sdpa``; it exists so the wiring is
  tested without a GPU.
- ``auto`` (the default): ``varlen`` on CUDA with packed rows, a 16-bit compute dtype and a
  torch that has ``varlen_attn``; ``sdpa`` otherwise (``resolve_cuda``; spec.py off CUDA).
- any other name transformers knows (``eager``, ``flex_attention``, ``flash_attention_2``) is
  passed to it unchanged.

Generation with a KV cache and a padding mask (llama_fsdp/eval.py) runs under
``standard_attention``, which switches a varlen model to SDPA for its duration.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch import nn

log = logging.getLogger(__name__)

VARLEN = "varlen"
AUTO = "auto"
FALLBACK = "sdpa"
SIXTEEN_BIT = ("bfloat16", "float16")


def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


_VARLEN_ATTN = _varlen_fn()


def varlen_available() -> bool:
    """Whether this torch has ``torch.nn.attention.varlen.varlen_attn`` (2.10 and later)."""
    return _VARLEN_ATTN is not None


def resolve_cuda(name: str, *, compute_dtype: str, packing: bool) -> str:
    """``model.attn_implementation`` on a CUDA run: ``auto`` is varlen for packed rows (unpacked,
    SDPA takes its causal flash path) in 16-bit (flash) where torch has varlen_attn."""
    if name != AUTO:
        return name
    fits = packing and compute_dtype in SIXTEEN_BIT and varlen_available()
    return VARLEN if fits else FALLBACK


def problems(name: str, *, compute_dtype: str) -> list[str]:
    """What is wrong with an explicit ``model.attn_implementation=varlen`` on a CUDA run."""
    if name != VARLEN:
        return []
    out = []
    if compute_dtype not in SIXTEEN_BIT:
        out.append(f"model.attn_implementation=varlen needs 16-bit compute on CUDA (flash), but "
                   f"the compute dtype is {compute_dtype}: use precision=mixed or precision=bf16, "
                   "or model.attn_implementation=sdpa")
    if not varlen_available():
        out.append(f"model.attn_implementation=varlen needs torch.nn.attention.varlen (torch >= "
                   f"2.10); this torch is {torch.__version__}: use model.attn_implementation=sdpa")
    return out


# ---------------------------------------------------------------------------------------------
# Boundaries, on the host


@dataclass
class Bounds:
    """The records of one batch: cumulative lengths over its b·s flattened tokens (int32, on
    the batch's device), the longest record and b·s (host ints)."""

    cu: torch.Tensor
    longest: int
    tokens: int
    # the device position_ids these bounds were made for: the forward must pass that very
    # tensor (a batch run without model_inputs, or a backward recomputing another batch, would
    # otherwise use the wrong records in silence; every micro-batch has the same shape)
    positions: Optional[weakref.ref] = None


# The batch a varlen model is running, by id of its config (every module of a transformers
# model shares it), with a weak reference that tells a live config from a reused id. Not a
# keyword argument of the forward, on purpose: FSDP2's root moves every tensor argument to the
# device (the longest record would come back with a host sync per layer), and a compiled layer
# guards on its arguments (a new record count or length every batch, a recompile each). Set by
# model_inputs before the forward; the backward's recomputation (activation checkpointing)
# reads it again, before the next batch replaces it.
_RUNNING: dict[int, tuple[weakref.ref, Bounds]] = {}


def document_bounds(position_ids: torch.Tensor) -> Bounds:
    """The records of a CPU ``position_ids`` batch [b, s], on the host.

    A record starts at every row start and wherever the position does not follow the one before
    it (transformers' own rule, so the logits equal SDPA's with its block mask); padding
    continues the last record's positions, so it joins that record, as it does there.
    """
    pos = position_ids.numpy() if isinstance(position_ids, torch.Tensor) else position_ids
    b, s = pos.shape
    start = np.ones((b, s), dtype=bool)
    start[:, 1:] = np.diff(pos, axis=1) != 1
    cu = np.append(np.flatnonzero(start.ravel()), b * s).astype(np.int32)
    return Bounds(torch.from_numpy(cu), int(np.diff(cu).max()), b * s)


def uses_varlen(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == VARLEN


def model_inputs(model: nn.Module, batch: dict[str, torch.Tensor],
                 device: torch.device) -> dict[str, Any]:
    """A host batch on ``device``; for a varlen model, the batch's records become the ones its
    attention runs (computed from the CPU position_ids before they move: no sync; a batch
    without position_ids is one record per row, and gets them)."""
    out: dict[str, Any] = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    if uses_varlen(model):
        if batch.get("attention_mask") is not None:
            raise ValueError("model.attn_implementation=varlen takes records by position_ids, "
                             "not a padding attention_mask: pass position_ids (restarting per "
                             "record), or run the model under standard_attention(model)")
        ids = batch["input_ids"]
        pos = batch.get("position_ids")
        if pos is None:
            pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
            out["position_ids"] = pos.to(device, non_blocking=True)
        bounds = document_bounds(pos)
        bounds.cu = bounds.cu.to(device, non_blocking=True)
        bounds.positions = weakref.ref(out["position_ids"])
        key = id(model.config)
        # the entry goes with the model (its config): no device tensor outlives it
        _RUNNING[key] = (weakref.ref(model.config, lambda _, k=key: _RUNNING.pop(k, None)),
                         bounds)
    return out


def running_bounds(config: Any) -> Optional[Bounds]:
    """The bounds model_inputs set for the model of this config, if any."""
    entry = _RUNNING.get(id(config))
    return entry[1] if entry is not None and entry[0]() is config else None


# ---------------------------------------------------------------------------------------------
# The attention function


def _signature() -> tuple[dict[str, Any], bool, bool]:
    """varlen_attn's causal switch, whether it takes grouped-query k/v, and whether it takes a
    scale (read once, outside any compiled region)."""
    fn = _VARLEN_ATTN
    params = inspect.signature(fn).parameters if fn is not None else {}
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    # window_size: torch >= 2.11; is_causal: 2.10
    return causal, "enable_gqa" in params, "scale" in params


_CAUSAL, VARLEN_GQA, _TAKES_SCALE = _signature()


def _flash_varlen(q, k, v, cu, longest, scale):
    kwargs = dict(_CAUSAL)
    if _TAKES_SCALE:
        kwargs["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-6:
        raise ValueError(f"this torch's varlen_attn has no scale argument; attention scale "
                         f"{scale} is not its 1/sqrt(head_dim): use model.attn_implementation=sdpa")
    if q.shape[1] != k.shape[1]:
        if VARLEN_GQA:
            kwargs["enable_gqa"] = True
        else:  # repeat_kv's order: kv head j serves query heads j*rep .. (j+1)*rep - 1
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return _VARLEN_ATTN(q, k, v, cu, cu, longest, longest, **kwargs)


def _use_flash(q: torch.Tensor) -> bool:
    return q.is_cuda and _VARLEN_ATTN is not None


def _reference_varlen(q, k, v, cu, scale, batch: int, seq: int):
    """SDPA with the block-causal mask rebuilt from ``cu``: the definition varlen computes."""
    seg = torch.searchsorted(cu[1:-1].long(), torch.arange(batch * seq, device=q.device),
                             right=True).view(batch, seq)
    idx = torch.arange(seq, device=q.device)
    mask = (seg[:, :, None] == seg[:, None, :]) & (idx[:, None] >= idx[None, :])
    to_heads = lambda t: t.view(batch, seq, *t.shape[1:]).transpose(1, 2)  # noqa: E731
    out = torch.nn.functional.scaled_dot_product_attention(
        to_heads(q), to_heads(k), to_heads(v), attn_mask=mask[:, None], scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).reshape(batch * seq, *q.shape[1:])


def varlen_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                             dropout: float = 0.0, scaling: Optional[float] = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [b, heads, s, d], key / value [b, kv_heads, s,
    d]; returns [b, s, heads, d]."""
    if dropout:
        raise ValueError(f"varlen attention has no dropout (got {dropout})")
    return _records_attention(module.config, kwargs.get("position_ids"), query, key, value,
                              scaling), None


# Outside torch.compile (train.compile compiles each layer with static shapes): the bounds are
# read here, unseen by the compiler, so a new record count or length is no recompile. The
# kernel is opaque to the compiler anyway; the graph breaks around it, and the rest of the
# layer stays compiled with its fixed shapes.
@torch.compiler.disable
def _records_attention(config, position_ids, query, key, value, scaling):
    b, heads, s, d = query.shape
    bounds = running_bounds(config)
    if (bounds is None or bounds.tokens != b * s or position_ids is None
            or bounds.positions is None or bounds.positions() is not position_ids):
        raise RuntimeError(
            "model.attn_implementation=varlen has no record bounds for this batch "
            f"({b} x {s} tokens): call the model with llama_fsdp.attention.model_inputs(model, "
            "batch, device) (training, evaluation) or under standard_attention(model) "
            "(generation with a padding mask or a KV cache)")
    cu, longest = bounds.cu, bounds.longest
    flat = lambda t: t.transpose(1, 2).reshape(b * s, t.shape[1], d)  # noqa: E731
    q, k, v = flat(query), flat(key), flat(value)
    if _use_flash(q):
        if torch.is_autocast_enabled(q.device.type):
            # sharding=no_shard with precision=mixed runs DDP under autocast over fp32 weights:
            # RoPE leaves q and k in fp32 beside a bf16 v. SDPA has an autocast rule that casts
            # them; the varlen op has none, and flash takes one 16-bit dtype.
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        out = _flash_varlen(q, k, v, cu, longest, scaling)
    else:
        out = _reference_varlen(q, k, v, cu, scaling, b, s)
    return out.view(b, s, heads, d)


def register() -> None:
    """Make ``varlen`` a name transformers accepts for ``_attn_implementation``. It has no mask
    function on purpose: transformers then builds no mask and runs no packed-sequence check."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)


@contextlib.contextmanager
def standard_attention(model: nn.Module) -> Iterator[None]:
    """SDPA for the duration (generation: a padding mask and a KV cache, which varlen does not
    take); every module of a transformers model shares its config, so one switch covers all."""
    config = getattr(model, "config", None)
    if not uses_varlen(model):
        yield
        return
    config._attn_implementation = FALLBACK
    try:
        yield
    finally:
        config._attn_implementation = VARLEN


register()
