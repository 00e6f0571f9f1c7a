"""The Kubernetes and SkyPilot examples of docs/launching.md: each one's llama_fsdp command line
composes into a valid run spec under the environment its launcher gives each process, and its
plan fits the GPUs it asks for. There is no cluster here to run them on: the GPUs are stood in
(their count and name), everything else is the real compose, spec and plan."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from llama_fsdp.plan import make_plan
from tests.conftest import REPO, compose, spec_of

EXAMPLES = REPO / "docs" / "examples"


def _after_module(tokens: list[str]) -> list[str]:
    at = tokens.index("llama_fsdp")
    assert tokens[at - 1] == "-m", tokens
    return tokens[at + 1:]


def pytorchjob() -> tuple[list[str], int, int]:
    """The overrides of every replica (all the same), and the job's nodes and GPUs per node."""
    job = yaml.safe_load((EXAMPLES / "pytorchjob.yaml").read_text())
    replicas = job["spec"]["pytorchReplicaSpecs"]
    args = set()
    for spec in replicas.values():
        container = spec["template"]["spec"]["containers"][0]
        args.add(tuple(_after_module([*container["command"], *container["args"]])))
        assert container["resources"]["limits"]["nvidia.com/gpu"] == int(job["spec"]["nprocPerNode"])
    assert len(args) == 1, "every replica runs the same command"
    return list(args.pop()), sum(s["replicas"] for s in replicas.values()), \
        int(job["spec"]["nprocPerNode"])


def skypilot() -> tuple[list[str], int, int]:
    task = yaml.safe_load((EXAMPLES / "skypilot.yaml").read_text())
    run = task["run"].replace("\\\n", " ")
    line = next(x for x in run.splitlines() if "torchrun" in x)
    gpu, _, count = task["resources"]["accelerators"].partition(":")
    assert gpu == "H100"
    return _after_module(shlex.split(line)), task["num_nodes"], int(count)


@pytest.mark.parametrize("example", [pytorchjob, skypilot], ids=["pytorchjob", "skypilot"])
def test_an_example_composes_into_a_run_that_fits(example, monkeypatch, tmp_path):
    overrides, nodes, gpus = example()
    assert overrides[0] == "cluster=torchrun"
    world = nodes * gpus
    for key, value in {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(gpus),
                       "GROUP_WORLD_SIZE": str(nodes), "MASTER_ADDR": "node0",
                       "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    # the GPUs the launcher's nodes have, stood in (CUDA cannot exist here)
    monkeypatch.setattr("llama_fsdp.launchers.hosts.local_cuda_count", lambda: gpus)
    monkeypatch.setattr("llama_fsdp.launchers.hosts.local_bf16", lambda: True)
    h100 = ("NVIDIA H100 80GB HBM3", 85 * 10**9)
    monkeypatch.setattr("llama_fsdp.launchers.hosts.local_gpu", lambda: h100)
    out = next(o.split("=", 1)[1] for o in overrides if o.startswith("output_dir="))
    spec = spec_of(compose(overrides), launch_dir=Path(tmp_path))
    assert (spec.device, spec.nodes, spec.nproc_per_node, spec.world_size) == (
        "cuda", nodes, gpus, world)
    assert spec.gpu == "h100" and spec.output_dir == out
    plan = make_plan(spec)
    assert plan.fits, plan.table()
