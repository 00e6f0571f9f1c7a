"""What this host has, for the launchers whose ranks run here (local, torchrun): its GPUs, as
torch sees them, and its RAM. The launchers put the answers in a ``Placement``
(llama_fsdp/config/placement.py); nothing else asks the host.

torch is imported only to count and name the GPUs, where cluster.device is auto or cuda and
the host has a GPU driver: a CPU run, and an auto one on a host without a driver, plan without
importing it (1-4 s of the command's start).
"""
from __future__ import annotations

import glob
import os
import sys
from typing import Any, Optional

from ..config.placement import Placement

# what a GPU driver that torch.cuda can use shows: NVIDIA's device nodes, WSL's GPU
# paravirtualization, AMD's ROCm compute node (torch.cuda under ROCm)
GPU_DEVICE_NODES = ("/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd")


def no_gpu_driver() -> bool:
    """Whether this host certainly has no GPU torch.cuda could see (Linux without any of the
    device nodes a driver makes); False where that cannot be told without asking torch."""
    return sys.platform.startswith("linux") and not any(glob.glob(p) for p in GPU_DEVICE_NODES)


def local_gpu() -> Optional[tuple[str, int]]:
    """(name, total memory in bytes) of this host's first visible GPU, or None."""
    if no_gpu_driver():
        return None
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            props = torch.cuda.get_device_properties(0)
            return props.name, int(props.total_memory)
    except (ImportError, RuntimeError):
        pass
    return None


def local_bf16() -> bool:
    """Whether this host's GPU computes in bf16 (False without one)."""
    if no_gpu_driver():
        return False
    try:
        import torch

        return bool(torch.cuda.is_bf16_supported())
    except (ImportError, RuntimeError):
        return False


def local_cuda_count() -> int:
    """The GPUs this process sees (0 without CUDA)."""
    if no_gpu_driver():
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def ram_bytes() -> int:
    """This host's RAM."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def visible_gpu_problems(device: str, nproc: int, gpus: int) -> list[str]:
    """Ranks on this host need as many GPUs as there are ranks."""
    if device != "cuda":
        return []
    if gpus == 0:
        return ["cluster.device=cuda but no CUDA device is visible: use cluster.device=cpu"]
    if nproc > gpus:
        return [f"cluster.nproc_per_node={nproc} but only {gpus} GPU(s) are visible: use "
                f"cluster.nproc_per_node<={gpus}"]
    return []


def this_host(cfg: Any, *, nodes: int, nproc: Optional[int],
              problems: list[str]) -> Placement:
    """The placement of ranks that run on this host (``nproc``: ranks per node, None: one per
    visible GPU, or 2 CPU ranks). A dry run plans for GPUs it need not have; a real launch
    checks that they are there."""
    c = cfg.cluster
    gpus = 0 if c.device == "cpu" else local_cuda_count()
    device = c.device if c.device != "auto" else ("cuda" if gpus > 0 else "cpu")
    if nproc is None:
        nproc = c.nproc_per_node if c.nproc_per_node is not None else (
            max(gpus, 1) if device == "cuda" else 2)
    gpu = local_gpu() if device == "cuda" else None
    if not cfg.dry_run:
        problems = problems + visible_gpu_problems(device, nproc, gpus)
    return Placement(device=device, nodes=nodes, nproc_per_node=nproc, on_this_host=True,
                     gpus_per_node=gpus, gpu_name=gpu[0] if gpu else None,
                     gpu_memory_bytes=gpu[1] if gpu else None,
                     gpu_bf16=local_bf16() if gpus > 0 else None,
                     ram_bytes=ram_bytes(), ram_source="this host's RAM",
                     problems=tuple(problems))
