"""Host tensors onto the device without a host sync: a batch (attention.model_inputs), the
targets' indices (loss.target_rows), the records' bounds.

``Tensor.to(cuda, non_blocking=True)`` is asynchronous only from page-locked memory; from
ordinary (pageable) memory the host waits while the driver stages it, which can be behind the
step the GPU is still running, and then the GPU waits for the host to queue the next one. So a
CUDA copy goes through torch's pinned-memory cache first (as HF Trainer's
``dataloader_pin_memory``, on by default); the cache keeps each pinned buffer until its copy is
done. On the CPU nothing moves."""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
