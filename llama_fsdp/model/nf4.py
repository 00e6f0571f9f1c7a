"""NF4 (torchao's NF4Tensor, the QLoRA base) under FSDP2: how each rank quantizes only its own
rows, dequantizes a weight chunk by chunk, and computes through it.

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

The layout's arithmetic (shapes, bytes, the code table) is llama_fsdp/config/nf4.py's.
"""
from __future__ import annotations

from typing import Any

from ..config.nf4 import INNER, NF4_TABLE, chunk_elements


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
    flat, step = out.view(-1), chunk_elements(w.block_size * w.scaler_block_size)
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
