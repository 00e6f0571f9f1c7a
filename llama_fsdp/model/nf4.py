"""NF4 (torchao's NF4Tensor, the QLoRA base) under FSDP2: which shapes shard, how many bytes a
shard takes, and how each rank quantizes only its own rows.

``to_nf4(w, block_size=64, scaler_block_size=256)`` of a weight of N elements holds::

    quantized_data      uint8, N/2          two 4-bit codes per byte, row-major
    quantized_scalers   int8,  N/64         one absmax per block, double-quantized
    quantization_factor w.dtype, N/16384    one per group of scaler_block_size blocks
    scaler_mean         w.dtype, 0-d        the mean of ALL block absmaxes of the tensor
    nf4                 w.dtype, 16         the lookup table

FSDP2 shards the first three along the flat row-major order (``torch.chunk`` -> NF4's split,
which cuts every inner tensor into equal flat pieces and cannot pad) and all-gathers them in 4
bits; ``scaler_mean`` and the table travel as metadata, so after the all-gather every rank
rebuilds the weight with its own ``scaler_mean``: that mean must be the whole tensor's. Hence
``quantize_rows`` (the rank's rows, the mean over every rank's block absmaxes: bit-identical to
``to_nf4(full)`` then sharding) and ``shard_problems`` (rows split evenly, whole scaler groups
per shard).

Pure arithmetic at import (the planner and the spec use it without torch); torch and torchao
are imported by the functions that quantize.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from ..config.projections import projection_shapes

# The inner tensors of an NF4Tensor (FSDP2 shards the first three).
INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
LUT_SIZE = 16
# torchao's nearest-code search runs in chunks of this many elements (nf4_tensor.CHUNK_SIZE)
SEARCH_CHUNK = 1 << 20
# Elements ``dequantize`` decodes at a time (whole scaler groups): its temporaries are one
# chunk's, (8 + 2c) bytes an element at most (the codes as int64 indices beside their looked-up
# values, then those beside their scaled values). Each chunk is ~15 small ops (~0.1 ms of host
# time here): 2^24 keeps a GPU's kernels large enough to hide that (14 chunks for 70B's largest
# projection) at 0.2 GB of temporaries in bf16.
DEQUANT_CHUNK = 1 << 24
# torchao's NF4 code values (NF4Tensor.from_tensor's table)
NF4_TABLE = (-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609,
             0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0)


def shard_problems(shape: Sequence[int], shard: int, block_size: int,
                   scaler_block_size: int) -> Optional[str]:
    """Why an NF4 weight of ``shape`` cannot be quantized, or sharded over ``shard`` ranks
    (dim-0 shards), or None when it can.

    to_nf4 needs whole scaler groups (N % (block_size * scaler_block_size) == 0). FSDP2 gives a
    rank ceil(rows / shard) rows and pads the last ones, which NF4 cannot (no partial shards):
    rows % shard == 0, and every shard must hold whole scaler groups.
    """
    if len(shape) != 2:
        return f"NF4 weights must be 2-D, got {tuple(shape)}"
    rows, cols = int(shape[0]), int(shape[1])
    numel, group = rows * cols, block_size * scaler_block_size
    if numel % group:
        return (f"{numel:,} elements are not whole groups of nf4_block_size x "
                f"nf4_scaler_block_size = {group:,}")
    if shard > 1 and rows % shard:
        return f"its {rows:,} rows do not split evenly over {shard} shards"
    if shard > 1 and (numel // shard) % group:
        return (f"a shard of {numel // shard:,} elements over {shard} shards is not whole groups "
                f"of {group:,} elements")
    return None


def shard_bytes(numel: int, *, dtype_bytes: int, block_size: int, scaler_block_size: int,
                shard: int = 1) -> int:
    """Bytes of one rank's shard of an NF4 weight of ``numel`` elements: codes, scales,
    quantization factors (in the dtype it was quantized from, ``dtype_bytes``), and the mean and
    table every shard keeps whole."""
    local = numel // shard
    return (local // 2 + local // block_size
            + local // (block_size * scaler_block_size) * dtype_bytes
            + (1 + LUT_SIZE) * dtype_bytes)


def quantize_bytes(numel: int, *, dtype_bytes: int, block_size: int) -> int:
    """Temporaries of quantizing ``numel`` elements (``quantize_rows``) beyond its input and
    output: the scaled blocks and the codes (numel x (c + 1.5)), the block absmaxes (3 copies),
    and one chunk of the nearest-code search (SEARCH_CHUNK x (32c + c + 9): the distances to
    the 16 codes and their argmin)."""
    c = dtype_bytes
    return (SEARCH_CHUNK * (32 * c + c + 9) + int(numel * (c + 1.5))
            + 3 * c * (numel // block_size))


def dequantize_bytes(numel: int, *, dtype_bytes: int, block_size: int,
                     scaler_block_size: int) -> int:
    """Peak bytes of ``dequantize`` (one NF4 linear's forward, or its backward) of a weight of
    ``numel`` elements into a ``dtype_bytes`` compute dtype: the result, and one chunk's
    temporaries, (8 + 2c) bytes an element (benchmarks/long_context.md)."""
    return numel * dtype_bytes + (min(numel, _chunk(block_size * scaler_block_size))
                                  * (8 + 2 * dtype_bytes))


def _chunk(group: int) -> int:
    """Elements ``dequantize`` decodes at a time: whole scaler groups of ``group`` elements."""
    return max(group, DEQUANT_CHUNK // group * group)


# --- torch -----------------------------------------------------------------------------------


def nf4_module() -> Any:
    """torchao's NF4 module (torchao 0.18: quantization.quantize_.workflows.nf4.nf4_tensor)."""
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    return nf4_tensor


def is_nf4(t: Any) -> bool:
    return isinstance(t, nf4_module().NF4Tensor)


def quantize_rows(local: Any, *, block_size: int, scaler_block_size: int,
                  group: Any = None) -> Any:
    """This rank's rows of a weight as the NF4 shard ``to_nf4(full)`` sharded would give it.

    Every NF4 value is local to its scaler group except ``scaler_mean``, the mean of all the
    tensor's block absmaxes: the ranks of ``group`` all-gather their block absmaxes (1/64 of
    the weight) and take the same mean as to_nf4. The steps are torchao's
    (``NF4Tensor.from_tensor`` / ``double_quantize_scalers``) with that mean passed in.
    """
    import torch
    import torch.distributed as dist

    m = nf4_module()
    assert local.dim() == 2 and local.is_contiguous()
    blocks = local.numel() // block_size
    scalers = m.get_block_absmax(local.flatten(), block_size)
    if group is not None and dist.get_world_size(group) > 1:
        every = scalers.new_empty(scalers.numel() * dist.get_world_size(group))
        # torch 2.13 renamed all_gather_into_tensor (2.11 has only the old name)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(every, scalers.contiguous(), group=group)
        mean = every.mean()
    else:
        mean = scalers.mean()
    centred = scalers - mean
    groups = centred.numel() // scaler_block_size
    absmax = m.get_block_absmax(centred, scaler_block_size).unsqueeze(-1)
    factor = 256 / (2 * absmax.expand(groups, scaler_block_size))
    q_scalers = ((centred.view(groups, scaler_block_size) * factor).round()
                 .clamp(-128, 127).flatten().to(torch.int8))
    # A fresh buffer, not factor[:, 0].contiguous(): with one group that view is (1,) with
    # stride (256,), which torch calls contiguous and FSDP2's byte view of mixed-dtype
    # all-gather inputs refuses ("stride(-1) must be 1").
    q_factor = torch.empty(groups, dtype=factor.dtype, device=factor.device).copy_(factor[:, 0])
    table = torch.tensor(NF4_TABLE, device=local.device, dtype=local.dtype)
    codes = m.NF4Tensor.convert_to_norm_float_weight(local, blocks, block_size, table)
    meta = m.SubclassTensorArgs(local.size(), local.stride(), local.storage_offset(),
                                local.dtype, local.device, False)
    return m.NF4Tensor(meta, block_size, blocks, scaler_block_size, q_scalers, q_factor,
                       mean.detach().clone(), codes, table)


def dequantize(w: Any, dtype: Any) -> Any:
    """NF4 weight ``w`` as a ``dtype`` tensor, bit-identical to torchao's
    ``w.get_original_weight().to(dtype)``, decoded into one preallocated buffer a chunk of
    whole scaler groups at a time: its peak is the result plus one chunk's temporaries, where
    get_original_weight holds every code as int64 beside three copies of the weight."""
    import torch

    assert w.is_contiguous(), "NF4 weights are row-major"
    data = w.quantized_data
    out = torch.empty(w.shape, dtype=dtype, device=data.device)
    flat, step = out.view(-1), _chunk(w.block_size * w.scaler_block_size)
    for start in range(0, flat.numel(), step):
        end = min(start + step, flat.numel())
        flat[start:end].copy_(_decoded(w, start, end))
    return out


def _decoded(w: Any, start: int, end: int) -> Any:
    """Elements [start, end) of ``w`` (whole scaler groups) in w's dtype: the steps of
    torchao's get_original_weight and dequantize_scalers, element for element."""
    import torch

    bs, sbs = w.block_size, w.scaler_block_size
    first, last = start // bs, end // bs
    scaled = w.quantized_scalers[first:last].view(-1, sbs)
    factor = w.quantization_factor[first // sbs:last // sbs].unsqueeze(-1)
    scalers = (scaled / factor).flatten().to(w.dtype) + w.scaler_mean
    packed = w.quantized_data[start // 2:end // 2]  # two codes a byte, the first one high
    codes = torch.stack([packed >> 4, packed & 0b1111], dim=-1).view(-1).long()
    return (w.nf4[codes].view(-1, bs) * scalers.unsqueeze(-1)).view(-1)


def _linear_function() -> Any:
    import torch
    import torch.nn.functional as F

    class LinearNF4(torch.autograd.Function):
        """torchao's LinearNF4 (y = x W^T, dx = dy W, no gradient of the frozen W) with the
        lean ``dequantize``: only the NF4 weight is saved, and each W lives only in its
        matmul."""

        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any) -> Any:
            ctx.save_for_backward(weight)
            return F.linear(x, dequantize(weight, x.dtype))

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            (weight,) = ctx.saved_tensors
            if not ctx.needs_input_grad[0]:
                return None, None
            return grad @ dequantize(weight, grad.dtype), None

    return LinearNF4


_LINEAR: list[Any] = []


def linear(x: Any, weight: Any) -> Any:
    """x @ weight^T for an NF4 ``weight`` (whole: plain, or all-gathered by FSDP2), equal bit
    for bit to torchao's ``linear_nf4`` in forward and in the input's gradient. Under
    torch.compile it is torchao's linear_nf4: inductor fuses that decode into one kernel that
    holds only its result (benchmarks/long_context.md), where this chunked copy holds more."""
    import torch

    if torch.compiler.is_compiling():
        return nf4_module().linear_nf4(x, weight)
    if not _LINEAR:
        _LINEAR.append(_linear_function())
    return _LINEAR[0].apply(x, weight)


def tensor_bytes(t: Any) -> int:
    """Bytes an NF4Tensor holds (every inner tensor)."""
    return sum(getattr(t, a).numel() * getattr(t, a).element_size() for a in INNER)


def inner_tensors(t: Any) -> list[Any]:
    return [getattr(t, a) for a in INNER]


def target_problems(ft: Any, m: Any, shard: int) -> list[str]:
    """finetune=qlora: each target projection of model ``m`` that cannot be NF4 over a shard
    group of ``shard`` ranks, with the fixes (the shard sizes that work, lora, fewer targets)."""
    def bad_at(n: int) -> dict[str, str]:
        out = {}
        for name in ft.target_modules:
            why = shard_problems(shapes[name], n, ft.nf4_block_size, ft.nf4_scaler_block_size)
            if why:
                out[name] = why
        return out

    shapes = projection_shapes(m)
    bad = bad_at(shard)
    if not bad:
        return []
    first = next(iter(bad))
    ok = [n for n in range(1, 65) if not bad_at(n)]
    fixes = [f"a shard group of {', '.join(map(str, ok[:8]))} rank(s) (cluster.nproc_per_node, "
             "cluster.nodes, sharding.shard_size)"] if ok else []
    fixes += ["finetune=lora (a 16-bit base shards any way)",
              f"leave {', '.join(bad)} out of finetune.target_modules"
              if len(bad) < len(ft.target_modules) else ""]
    return [f"finetune=qlora: {', '.join(bad)} cannot be stored in NF4 over {shard} shard(s) "
            f"({first} {shapes[first][0]} x {shapes[first][1]}: {bad[first]}). Use "
            + "; or ".join(f for f in fixes if f)]
