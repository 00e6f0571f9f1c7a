"""A local run's rendezvous store listens on loopback only: nothing off this host can reach
the ranks' key-value store (or connect to the port at all)."""
from __future__ import annotations

import os

import pytest

from llama_fsdp.launchers.environment import free_port
from tests.conftest import make_spec
from tests.distributed import run_ranks

pytestmark = [pytest.mark.dist]


def _listening(rank, world, spec, port):
    """The process group as a rank of a local launch makes it (MASTER_ADDR=127.0.0.1), then
    the addresses this process listens on at the rendezvous port."""
    import psutil
    import torch.distributed as dist

    from llama_fsdp.train.distributed import DistEnv, init_distributed

    dist.destroy_process_group()  # the helper's own group: make the worker's
    os.environ["MASTER_PORT"] = str(port)
    init_distributed(spec, DistEnv.from_environ())
    dist.barrier()
    out = [c.laddr.ip for c in psutil.Process().net_connections("tcp")
           if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    dist.barrier()
    return out


def test_the_local_rendezvous_store_binds_loopback_only(tmp_path):
    """Before: given MASTER_ADDR=127.0.0.1, rank 0's TCPStore listened on every interface
    (0.0.0.0 / ::)."""
    spec = make_spec(["cluster.nproc_per_node=2"], output_dir=tmp_path)
    port = free_port()
    listening = run_ranks(_listening, 2, spec, port)
    assert listening[0] and set(listening[0]) == {"127.0.0.1"}, listening
    assert listening[1] == []  # only rank 0 serves the store
