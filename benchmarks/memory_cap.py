"""A smaller card on a bigger one: a ``train.callbacks`` hook that caps the CUDA caching
allocator of each rank at ``$MEMORY_CAP_GB`` GB (10^9 bytes) with
``torch.cuda.set_per_process_memory_fraction``, so a run on an H200 fails as it would on a
24 GB card when it needs more (the GPU check's 8B QLoRA at 65,536 tokens: issue 50).

    MEMORY_CAP_GB=24 python -m llama_fsdp ... cluster.device_memory_gb=24 \
        'train.callbacks=["benchmarks.memory_cap:MemoryCap"]'

The cap counts what the allocator reserves (the CUDA context, ~0.5 GB, is outside it: a 24 GiB
card holds 25.8 GB, so a 24 GB cap is the stricter). It is set when the callbacks are built,
after the model and before the first step: the model's bytes are already inside it. Without
CUDA, or with the variable unset, it does nothing and says so.
"""
from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("llama_fsdp.benchmarks.memory_cap")  # shown with the run's own lines
CAP_ENV = "MEMORY_CAP_GB"


def fraction(cap_gb: float, total_bytes: int) -> float:
    """The allocator fraction that is ``cap_gb`` GB of a ``total_bytes`` card (at most 1)."""
    if cap_gb <= 0:
        raise ValueError(f"{CAP_ENV}={cap_gb}: a positive number of GB")
    return min(1.0, cap_gb * 1e9 / total_bytes)


class MemoryCap:
    """The ``train.callbacks`` factory and (no-op) step hook."""

    def __init__(self, rank: int = 0, world_size: int = 1, output_dir: Any = None):
        import torch

        self.cap_gb = float(os.environ.get(CAP_ENV) or 0) or None
        if self.cap_gb is None or not torch.cuda.is_available():
            log.info("memory cap: not applied (%s)", f"{CAP_ENV} unset" if self.cap_gb is None
                     else "no CUDA")
            return
        device = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(fraction(self.cap_gb, total), device)
        log.info("memory cap: the CUDA allocator of rank %d capped at %.2f GB of the card's "
                 "%.2f GB (%.2f GB reserved now)", rank, self.cap_gb, total / 1e9,
                 torch.cuda.memory_reserved(device) / 1e9)

    def __call__(self, state: Any) -> None:
        return None
