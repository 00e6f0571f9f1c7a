"""What the third GPU session found (benchmarks/gpu.md), held on the CPU where it can be.

- checkpointing.offload's CUDA ``unpack`` finds its record in the waiting list (``in``,
  ``remove``): records compare by identity, never by their tensors (a dataclass's ``==`` did,
  and raised for any activation of more than one element).
- MLflow installed as ``mlflow-skinny`` (the client alone, as the GPU's wheelhouse carries it)
  has no ``mlflow`` distribution: the run summary's ``mlflow ui`` line raised at the end of
  every run there.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError

import torch

from llama_fsdp.model import offload
from llama_fsdp.tracking import mlflow_compat, store


def test_offload_records_are_found_by_identity():
    cpu = torch.device("cpu")
    a, b = offload._Packed(torch.ones(4, 2), cpu), offload._Packed(torch.ones(4, 2), cpu)
    waiting = [a, b]
    assert b in waiting and offload._Packed(torch.ones(4, 2), cpu) not in waiting
    waiting.remove(b)
    assert waiting == [a] and waiting[0] is a


def test_mlflow_skinny_alone_still_gives_the_version(monkeypatch):
    def version(name):
        if name == "mlflow":
            raise PackageNotFoundError(name)
        assert name == "mlflow-skinny", name
        return "3.17.2"

    monkeypatch.setattr(mlflow_compat, "version", version)
    assert mlflow_compat.mlflow_version() == "3.17.2"
    assert mlflow_compat.check_version() is None
    assert store.ui_command("sqlite:///x.db").endswith("--workers 1")
