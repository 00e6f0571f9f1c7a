"""Attention over packed rows: the records' boundaries from the host, not a dense mask.

``model.attn_implementation`` picks the kernel:

- ``sdpa``: transformers' SDPA. Packed rows (position_ids restarting at every record) make
  transformers build a dense b x 1 x s x s block-causal mask every forward: SDPA then cannot use
  its flash kernel on CUDA, computes every one of the s x s scores (on CPU too, where its causal
  path skips the upper half), the mask (and k/v repeated to every head) is saved for backward
  (memory in b·s², see plan.packed_mask_bytes), and transformers checks the packed mask with a
  host sync every forward (``masking_utils.find_packed_sequence_indices``).
- ``varlen`` (this module): the records' boundaries are computed on the host from the CPU
  position_ids before the batch moves to the device (``model_inputs``): no b x s x s mask, no
  host sync. Two kernels:

  - CUDA, 16-bit: ``torch.nn.attention.varlen.varlen_attn`` (flash attention) over the
    flattened tokens, each record its own sequence, no k/v repetition where the kernel takes
    grouped-query heads.
  - elsewhere (CPU): block-sparse SDPA. The row is cut into query chunks; chunk [c0, c1)
    attends only to keys [lo, c1), lo the earliest start (over the batch's rows) of the record
    holding token c0, under the exact block-causal mask of that window. Short records make
    every window a little wider than its chunk: the scores computed fall from s² (SDPA's mask)
    to about s·(chunk + record); long ones give causal's s²/2. The chunk size is chosen per
    batch by a cost model (``chunk_plan``). Faster than SDPA's mask and than causal attention
    over the whole row, most for short records (benchmarks/attention_cpu.md).
- ``auto`` (the default): ``varlen`` for packed rows on CUDA in 16-bit with a torch that has
  ``varlen_attn`` (``resolve_cuda``) and on CPU (spec.resolve_attention); ``sdpa`` otherwise.
- any other name transformers knows (``eager``, ``flex_attention``, ``flash_attention_2``) is
  passed to it unchanged.

Generation with a KV cache and a padding mask (llama_fsdp/objective/sft.py) runs under
``standard_attention``, which switches a varlen model to SDPA for its duration.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch import nn

from ..config.kernels import AUTO, SDPA, VARLEN
from .transfer import to_device

log = logging.getLogger(__name__)

FALLBACK = SDPA  # where varlen cannot run
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
    # the block-sparse plan (off CUDA): (c0, c1, lo, mask [b, 1, c1 - c0, c1 - lo]) per chunk
    chunks: Optional[list[tuple[int, int, int, torch.Tensor]]] = None
    # the chunks' masks as additive masks (0 / -inf) in the attention's dtype, made at the
    # first layer: SDPA would otherwise turn each bool mask into one of these in every layer,
    # and save that copy for backward; every layer now saves the same tensors
    additive: dict[torch.dtype, list[tuple[int, int, int, torch.Tensor]]] = field(
        default_factory=dict)
    # the device position_ids these bounds were made for: the forward must pass that very
    # tensor (a batch run without model_inputs, or a backward recomputing another batch, would
    # otherwise use the wrong records in silence; every micro-batch has the same shape)
    positions: Optional[weakref.ref] = None


class RunningBatch:
    """The records of the batch a varlen model is running: one per model, reachable from each
    of its modules (``running_batch``). Not a keyword argument of the forward, on purpose:
    FSDP2's root moves every tensor argument to the device (the longest record would come back
    with a host sync per layer), and a compiled layer guards on its arguments (a new record
    count or length every batch, a recompile each); a compiled layer guards on this holder only
    by identity, and the bounds are read inside the kernel, which the compiler does not trace.
    Set by model_inputs before the forward; the backward's recomputation (activation
    checkpointing) reads it again, before the next batch replaces it."""

    ATTR = "_llama_fsdp_running_batch"

    def __init__(self) -> None:
        self.bounds: Optional[Bounds] = None


def running_batch(model: nn.Module) -> RunningBatch:
    """The model's holder, made and handed to all its modules at the first call."""
    holder = model.__dict__.get(RunningBatch.ATTR)
    if holder is None:
        holder = RunningBatch()
        for m in model.modules():  # the attention modules among them (any wrappers too)
            m.__dict__[RunningBatch.ATTR] = holder
    return holder


def document_bounds(position_ids: torch.Tensor) -> Bounds:
    """The records of a CPU ``position_ids`` batch [b, s], on the host.

    A record starts at every row start and wherever the position does not follow the one before
    it (transformers' own rule, so the logits equal SDPA's with its block mask); padding
    continues the last record's positions, so it joins that record, as it does there.
    """
    pos = _host(position_ids)
    b, s = pos.shape
    start = record_starts(pos)
    cu = np.append(np.flatnonzero(start.ravel()), b * s).astype(np.int32)
    return Bounds(torch.from_numpy(cu), int(np.diff(cu).max()), b * s)


def _host(position_ids: Any) -> np.ndarray:
    if isinstance(position_ids, torch.Tensor):
        return position_ids.numpy()
    return np.asarray(position_ids)


def record_starts(pos: np.ndarray) -> np.ndarray:
    """[b, s] bool: where a record starts (every row start; wherever the position does not
    follow the one before it)."""
    start = np.ones(pos.shape, dtype=bool)
    start[:, 1:] = np.diff(pos, axis=1) != 1
    return start


# ---------------------------------------------------------------------------------------------
# The block-sparse plan (varlen off CUDA)

CHUNK_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)
# What one more chunk costs beside its scores, in score-element x head-dim units (multiply-adds):
# the SDPA call and its backward, the mask, and the key/value slices' backward (a zero-filled
# full-length gradient per chunk, summed: 2 x b x kv_heads x s x head_dim). Fitted on one CPU
# core (benchmarks/attention_cpu.py): the chosen size is within 10% of the best measured one.
CHUNK_CALL_COST = 400_000


def record_firsts(start: np.ndarray) -> np.ndarray:
    """[s]: for each position, the earliest start over the rows of the record holding it (the
    first key a query there can need); ``start`` is record_starts' [b, s] flags."""
    idx = np.arange(start.shape[1])
    # each token's record start; along a row, the starts only grow
    return np.maximum.accumulate(np.where(start, idx, 0), axis=1).min(axis=0)


def chunk_plan(position_ids: Any, *, heads: int, kv_heads: int, head_dim: int,
               size: Optional[int] = None) -> list[tuple[int, int, int, np.ndarray]]:
    """The block-sparse plan of a CPU position_ids batch: (c0, c1, lo, mask) per query chunk
    [c0, c1), lo its first key, the mask [b, 1, c1 - c0, c1 - lo] the exact block-causal mask
    of that window (transformers' segments: padding joins the last record). ``size``: the chunk
    length; default the cheapest of CHUNK_SIZES by the cost model above (one chunk of the whole
    row, SDPA's mask, is a candidate up to the largest size), so the windows hold at most
    s²/2 + s·min(s, 2048)/2 scores per row."""
    pos = _host(position_ids)
    b, s = pos.shape
    start = record_starts(pos)
    first = record_firsts(start)

    def windows(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c0 = np.arange(0, s, n)
        return c0, np.minimum(c0 + n, s), first[c0]

    def cost(n: int) -> float:
        c0, c1, lo = windows(n)
        area = float(((c1 - c0) * (c1 - lo)).sum())
        return b * heads * head_dim * area + len(c0) * (2 * b * kv_heads * s * head_dim
                                                        + CHUNK_CALL_COST)

    if size is None:  # the whole row only where it is no longer than the largest chunk
        size = min([n for n in CHUNK_SIZES if n < s] + ([s] if s <= CHUNK_SIZES[-1] else []),
                   key=cost)
    seg = np.cumsum(start, axis=1)
    idx = np.arange(s)
    plan = []
    for a, z, lo in zip(*(w.tolist() for w in windows(size))):
        same = seg[:, a:z, None] == seg[:, None, lo:z]
        causal = idx[a:z, None] >= idx[None, lo:z]
        plan.append((a, z, lo, (same & causal)[:, None]))
    return plan


def block_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           chunks: list[tuple[int, int, int, torch.Tensor]],
                           scale: Optional[float]) -> torch.Tensor:
    """query [b, heads, s, d], key / value [b, kv_heads, s, d] -> [b, s, heads, d]: SDPA per
    query chunk over its key window (the queries split, so their gradient is one cat; the
    windows overlap, so each key slice's gradient is summed)."""
    gqa = query.shape[1] != key.shape[1]
    sizes = [z - a for a, z, _, _ in chunks]
    outs = [
        torch.nn.functional.scaled_dot_product_attention(
            q, key[:, :, first:z], value[:, :, first:z], attn_mask=mask, scale=scale,
            enable_gqa=gqa).transpose(1, 2)
        for q, (_, z, first, mask) in zip(query.split(sizes, dim=2), chunks)]
    return torch.cat(outs, dim=1)  # [b, s, heads, d], contiguous: o_proj's reshape is a view


def _chunks(config: Any, position_ids: torch.Tensor,
            device: torch.device) -> list[tuple[int, int, int, torch.Tensor]]:
    """chunk_plan for a transformers config's heads, its masks on ``device``."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    plan = chunk_plan(position_ids, heads=heads, kv_heads=config.num_key_value_heads,
                      head_dim=head_dim)
    return [(a, z, lo, torch.from_numpy(m).to(device, non_blocking=True))
            for a, z, lo, m in plan]


def additive_chunks(chunks: list[tuple[int, int, int, torch.Tensor]],
                    dtype: torch.dtype) -> list[tuple[int, int, int, torch.Tensor]]:
    """The chunks with their bool masks as additive masks of ``dtype`` (0 where a query may
    look, -inf where not; every query row sees at least itself, so no row is all -inf)."""
    def add(mask: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return out.masked_fill_(~mask, float("-inf"))

    return [(a, z, lo, add(m)) for a, z, lo, m in chunks]


def uses_varlen(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == VARLEN


def model_inputs(model: nn.Module, batch: dict[str, torch.Tensor],
                 device: torch.device) -> dict[str, Any]:
    """A host batch on ``device``; for a varlen model, the batch's records become the ones its
    attention runs (computed from the CPU position_ids before they move: no sync; a batch
    without position_ids is one record per row, and gets them)."""
    out: dict[str, Any] = {k: to_device(v, device) for k, v in batch.items()}
    if uses_varlen(model):
        if batch.get("attention_mask") is not None:
            raise ValueError("model.attn_implementation=varlen takes records by position_ids, "
                             "not a padding attention_mask: pass position_ids (restarting per "
                             "record), or run the model under standard_attention(model)")
        ids = batch["input_ids"]
        pos = batch.get("position_ids")
        if pos is None:
            pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
            out["position_ids"] = to_device(pos, device)
        bounds = document_bounds(pos)
        bounds.cu = to_device(bounds.cu, device)
        if not _use_flash(device):  # the block-sparse SDPA will run
            bounds.chunks = _chunks(model.config, pos, device)
        bounds.positions = weakref.ref(out["position_ids"])
        running_batch(model).bounds = bounds  # goes with the model: no global outlives it
    return out


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


def _use_flash(device: torch.device) -> bool:
    """Whether torch's flash varlen_attn runs on ``device`` (else the block-sparse SDPA)."""
    return device.type == "cuda" and _VARLEN_ATTN is not None


def varlen_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                             dropout: float = 0.0, scaling: Optional[float] = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [b, heads, s, d], key / value [b, kv_heads, s,
    d]; returns [b, s, heads, d]."""
    if dropout:
        raise ValueError(f"varlen attention has no dropout (got {dropout})")
    return _records_attention(module, kwargs.get("position_ids"), query, key, value,
                              scaling), None


# Outside torch.compile (train.compile compiles each layer with static shapes): the bounds are
# read here, unseen by the compiler, so a new record count or length is no recompile. The
# kernel is opaque to the compiler anyway; the graph breaks around it, and the rest of the
# layer stays compiled with its fixed shapes.
@torch.compiler.disable
def _records_attention(module, position_ids, query, key, value, scaling):
    b, heads, s, d = query.shape
    holder = module.__dict__.get(RunningBatch.ATTR)
    bounds = holder.bounds if holder is not None else None
    # A model called without model_inputs is refused, not run on records read from its
    # position_ids: transformers hands a registered kernel without a mask function no padding
    # mask (it drops it), so a padded batch would run as if unpadded, in silence.
    if (bounds is None or bounds.tokens != b * s or position_ids is None
            or bounds.positions is None or bounds.positions() is not position_ids):
        raise RuntimeError(
            "model.attn_implementation=varlen has no record bounds for this batch "
            f"({b} x {s} tokens): call the model with llama_fsdp.model.attention.model_inputs(model, "
            "batch, device) (training, evaluation) or under standard_attention(model) "
            "(generation with a padding mask or a KV cache)")
    device = query.device.type
    amp = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    if not _use_flash(query.device):
        if bounds.chunks is None:
            raise RuntimeError("model.attn_implementation=varlen: this batch was prepared for "
                               f"CUDA's kernel, and the model runs on {query.device}")
        dtype = amp or query.dtype  # SDPA computes in the autocast dtype
        if dtype not in bounds.additive:
            bounds.additive[dtype] = additive_chunks(bounds.chunks, dtype)
        return block_sparse_attention(query, key, value, bounds.additive[dtype], scaling)
    cu, longest = bounds.cu, bounds.longest
    flat = lambda t: t.transpose(1, 2).reshape(b * s, t.shape[1], d)  # noqa: E731
    q, k, v = flat(query), flat(key), flat(value)
    if amp is not None:
        # sharding=no_shard with precision=mixed runs DDP under autocast over fp32 weights:
        # RoPE leaves q and k in fp32 beside a bf16 v. SDPA has an autocast rule that casts
        # them; the varlen op has none, and flash takes one 16-bit dtype.
        q, k, v = q.to(amp), k.to(amp), v.to(amp)
    out = _flash_varlen(q, k, v, cu, longest, scaling)
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
