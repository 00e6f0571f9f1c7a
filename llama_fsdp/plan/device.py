"""What one device offers: its memory (the local GPU, the accelerator table, or the host's RAM
for CPU ranks) and its dense peak FLOP/s."""
from __future__ import annotations

import os
from typing import Optional

from ..run.spec import RunSpec

GB = 10**9

# What a CUDA process holds beside the step's tensors, through torch's caching allocator (so in
# torch.cuda.max_memory_allocated): cuBLAS / cuBLASLt workspaces, made at the first matmul and
# kept (64 MiB with torch 2.11 and CUDA 13: benchmarks/gpu.md).
CUDA_WORKSPACE_BYTES = 64 * 2**20


def runtime_bytes(spec: RunSpec) -> int:
    """Device memory the runtime holds beside the step's tensors: CUDA_WORKSPACE_BYTES on a GPU;
    0 on CPU (the CPU measurements subtract the runtime's few MB as process overhead)."""
    return CUDA_WORKSPACE_BYTES if spec.device == "cuda" else 0


def device_capacity_bytes(spec: RunSpec) -> tuple[int, str]:
    """(bytes one rank may use, where that number came from)."""
    from ..config.devices import BY_KEY, DEFAULT_GPU

    c, place = spec.cluster, spec.placement
    if c.device_memory_gb is not None:
        return int(c.device_memory_gb * GB), "cluster.device_memory_gb"
    if spec.device == "cuda":
        if place.gpu_memory_bytes is not None:
            return place.gpu_memory_bytes, f"{place.gpu_name}, torch.cuda.get_device_properties"
        key = spec.gpu or DEFAULT_GPU
        return int(BY_KEY[key].memory_gb * GB), f"{key} (cluster.gpu_type table)"
    if place.ram_bytes is not None:
        return place.ram_bytes // spec.nproc_per_node, f"{place.ram_source} / ranks per node"
    # CPU ranks on nodes whose RAM the plan is not told: this host's, as a stand-in
    where = "host RAM / ranks per node"
    if not place.on_this_host:
        where = "this host's RAM (a stand-in) / ranks per node"
    return _host_ram_bytes() // spec.nproc_per_node, where


def _host_ram_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_flops(spec: RunSpec) -> Optional[float]:
    """Dense peak FLOP/s of one device for the run's compute dtype: cluster.peak_tflops, else
    the accelerator table (bf16, or TF32 for fp32); None on CPU or for an unknown GPU."""
    from ..config.devices import BY_KEY

    if spec.cluster.peak_tflops is not None:
        return spec.cluster.peak_tflops * 1e12
    if spec.device == "cuda" and spec.gpu is not None:
        return BY_KEY[spec.gpu].peak_flops(spec.policy.compute_dtype)
    return None
