"""GPU tests' shared fixture: a 1-rank NCCL process group (the tests skip without CUDA)."""
from __future__ import annotations

import os

import pytest

from llama_fsdp.launchers.environment import free_port


@pytest.fixture(scope="module")
def one_rank_group():
    """A 1-rank NCCL process group on cuda:0, as the worker makes one."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                            "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    port = free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
