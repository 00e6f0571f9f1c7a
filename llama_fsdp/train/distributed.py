"""A rank's process group: its place in the job from the environment (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE), its logging, its CPU threads and GPU, and the group itself
(gloo on CPU; NCCL for GPU tensors and gloo for CPU ones on CUDA)."""
from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from ..run.spec import RunSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @classmethod
    def from_environ(cls) -> "DistEnv":
        e = os.environ
        return cls(int(e.get("RANK", 0)), int(e.get("LOCAL_RANK", 0)),
                   int(e.get("WORLD_SIZE", 1)), int(e.get("LOCAL_WORLD_SIZE", 1)))


def setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank{rank}] %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)
    for noisy in ("alembic", "mlflow", "urllib3", "httpx", "filelock", "submitit"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cpus_for_rank(env: DistEnv) -> int:
    """CPUs this rank may use: SLURM's cpus-per-task, else its CPU affinity (what the job or
    container grants) split between the node's ranks."""
    if os.environ.get("SLURM_CPUS_PER_TASK"):
        return max(1, int(os.environ["SLURM_CPUS_PER_TASK"]))
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        available = os.cpu_count() or 1
    return max(1, available // max(env.local_world_size, 1))


def _gpu_for_rank(env: DistEnv) -> torch.device:
    n = torch.cuda.device_count()
    if env.local_rank >= n:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise RuntimeError(
            f"rank {env.rank} is local rank {env.local_rank} on {socket.gethostname()}, which "
            f"shows {n} GPU(s) (CUDA_VISIBLE_DEVICES={visible}): each rank needs a GPU of its "
            f"own. Launch at most {n} rank(s) per node (cluster.nproc_per_node / "
            "cluster.gpus_per_node)")
    return torch.device("cuda", env.local_rank)


def enable_tf32() -> None:
    """TF32 matmuls for fp32 compute. ``set_float32_matmul_precision`` sets the legacy flag and
    the fp32_precision setting (torch >= 2.9) together; setting only one of them makes a later
    read of the other raise ("mix of the legacy and new APIs"), and torch.compile reads both
    (dynamo the legacy flag, inductor the new setting). cuDNN's convolutions allow TF32 by
    default."""
    torch.set_float32_matmul_precision("high")


# The caching allocator's setting for CUDA ranks when the user sets none: segments that grow in
# place instead of a new block per odd size. The H200 check (benchmarks/gpu.md) measured 8B
# QLoRA reserving 13.30 GB for 8.31 GB allocated (1.60x; LoRA 1.02x): what a 24 GB card runs out
# of is the reserved memory, which the plan does not count. torchtitan launches with the same.
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF = "expandable_segments:True"


def allocator_settings(environ: Optional[dict] = None) -> Optional[str]:
    """Set ALLOC_CONF before CUDA starts unless the user set the allocator (either name torch
    reads); returns what was set, None when the user's setting stands."""
    environ = os.environ if environ is None else environ
    if ALLOC_CONF_ENV in environ or "PYTORCH_ALLOC_CONF" in environ:
        return None
    environ[ALLOC_CONF_ENV] = ALLOC_CONF
    if environ is os.environ and torch.cuda.is_initialized():  # read at CUDA's start: too late
        torch.cuda.memory._set_allocator_settings(ALLOC_CONF)
    return ALLOC_CONF


def init_distributed(spec: RunSpec, env: DistEnv) -> torch.device:
    """Process group with the init timeout; CUDA ranks get NCCL for GPU tensors and gloo for
    CPU ones (CPU offload's gradients, object collectives)."""
    torch.set_num_threads(spec.cluster.threads_per_rank or cpus_for_rank(env))
    timeout = datetime.timedelta(seconds=spec.cluster.init_timeout_s)
    store = _attempt_store(env, timeout) or _loopback_store(env, timeout)
    if spec.device == "cuda":
        if allocator_settings() and env.rank == 0:
            log.info("CUDA allocator: %s=%s (set %s yourself to choose another)",
                     ALLOC_CONF_ENV, ALLOC_CONF, ALLOC_CONF_ENV)
        device = _gpu_for_rank(env)
        torch.cuda.set_device(device)
        dist.init_process_group("cuda:nccl,cpu:gloo", device_id=device, timeout=timeout,
                                **store)
        if spec.policy.compute_dtype == "float32":
            enable_tf32()
            if env.rank == 0:
                log.info("precision=fp32 on CUDA: TF32 matmuls enabled (10-bit mantissa products, "
                         "fp32 accumulation); MFU is against the TF32 peak")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout, **store)
    if dist.get_world_size() != spec.world_size:
        raise RuntimeError(f"launched {dist.get_world_size()} ranks but the run expects "
                           f"{spec.world_size}: the launcher and the spec disagree")
    return device


def _attempt_store(env: DistEnv, timeout: datetime.timedelta) -> dict[str, Any]:
    """Under torchrun, whose workers share its agent's store across restarts
    (TORCHELASTIC_USE_AGENT_STORE=True), the process group's keys of each attempt under a
    prefix of their own: a restarted rank 0 otherwise reads a dead rank's address left by the
    attempt before and fails to connect (pytorch/pytorch#135712). The attempt is counted per
    rank in the store (every restart starts every rank once), not by TORCHELASTIC_RESTART_COUNT,
    which the agents of different nodes count apart. Elsewhere: {} (the env:// default)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          env.world_size, is_master=False, timeout=timeout)
    attempt = store.add(f"llama_fsdp/starts/rank{env.rank}", 1)
    return {"store": dist.PrefixStore(f"llama_fsdp/attempt{attempt}/", store),
            "rank": env.rank, "world_size": env.world_size}


def _loopback_store(env: DistEnv, timeout: datetime.timedelta) -> dict[str, Any]:
    """A launch on this host alone (MASTER_ADDR a loopback address, as the local launcher
    gives it): rank 0 serves the rendezvous store on that address only. torch's TCPStore
    listens on every interface whatever host it is given, which would let anything that
    reaches this machine talk to the ranks' store; handed a socket bound to loopback, it
    listens there. Elsewhere: {} (the env:// default)."""
    host, port = os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT") or 0)
    try:
        family, kind, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        loopback = ipaddress.ip_address(where[0]).is_loopback
    except (OSError, ValueError, IndexError):
        return {}
    if not loopback or not port:
        return {}
    listen_fd = None
    if env.rank == 0:
        sock = socket.socket(family, kind)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(max(env.world_size, 128))
        listen_fd = sock.detach()  # the store owns the descriptor from here
    store = dist.TCPStore(where[0], port, env.world_size, is_master=env.rank == 0,
                          timeout=timeout, master_listen_fd=listen_fd)
    return {"store": store, "rank": env.rank, "world_size": env.world_size}


_OPEN: Optional[tuple[DistEnv, torch.device]] = None  # the group process_group holds open


@contextlib.contextmanager
def process_group(spec: RunSpec) -> Iterator[tuple[DistEnv, torch.device]]:
    """This rank's place and device with its process group up while the block runs: logging set
    up and the group made on entry, destroyed on exit. Entered again while it is open, the open
    group (the torchrun launcher holds it for the job's once-only duties, then runs the worker
    in it)."""
    global _OPEN
    if _OPEN is not None:
        yield _OPEN
        return
    env = DistEnv.from_environ()
    setup_logging(env.rank)
    _OPEN = (env, init_distributed(spec, env))
    try:
        yield _OPEN
    finally:
        _OPEN = None
        dist.destroy_process_group()
