"""GPU: a batch goes to the device without the host waiting for the step the GPU is running
(llama_fsdp/model/transfer.py): the host queues it behind a long kernel and returns at once, and the
values arrive."""
from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_pageable_batch_is_queued_behind_running_work_without_a_host_wait():
    from llama_fsdp.model.transfer import to_device

    device = torch.device("cuda", 0)
    batch = torch.randint(0, 128256, (4, 2048))  # pageable, as the data loader makes it
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    torch.cuda._sleep(2_000_000_000)  # a kernel that keeps the GPU busy for about a second
    queued = time.perf_counter()
    moved = to_device(batch, device)
    returned = time.perf_counter() - queued
    torch.cuda.synchronize(device)
    busy = time.perf_counter() - start
    assert busy > 0.2, busy  # the kernel did hold the GPU
    assert returned < busy / 4, (returned, busy)  # the host did not wait for it
    assert torch.equal(moved.cpu(), batch)
