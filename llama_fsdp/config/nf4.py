"""NF4's layout (torchao's NF4Tensor, the QLoRA base) under FSDP2: which shapes shard, and how
many bytes a shard and its quantization take. Pure arithmetic: the checks, the planner and the
model's NF4 code (llama_fsdp/model/nf4.py, which says how a rank quantizes its rows) read it.

``to_nf4(w, block_size=64, scaler_block_size=256)`` of a weight of N elements holds::

    quantized_data      uint8, N/2          two 4-bit codes per byte, row-major
    quantized_scalers   int8,  N/64         one absmax per block, double-quantized
    quantization_factor w.dtype, N/16384    one per group of scaler_block_size blocks
    scaler_mean         w.dtype, 0-d        the mean of ALL block absmaxes of the tensor
    nf4                 w.dtype, 16         the lookup table

FSDP2 shards the first three along the flat row-major order and cannot pad them: hence
``shard_problems`` (rows split evenly, whole scaler groups per shard).
"""
from __future__ import annotations

from typing import Optional, Sequence


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
    return numel * dtype_bytes + (min(numel, chunk_elements(block_size * scaler_block_size))
                                  * (8 + 2 * dtype_bytes))


def chunk_elements(group: int) -> int:
    """Elements ``dequantize`` decodes at a time: whole scaler groups of ``group`` elements."""
    return max(group, DEQUANT_CHUNK // group * group)
