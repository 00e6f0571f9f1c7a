"""The environment every rank gets from its launcher (quiet tokenizers, no hub, NCCL's flight
recorder, and glibc malloc settings for CPU ranks), set for the processes a block starts and
restored after it, and the local rendezvous port."""
from __future__ import annotations

import logging
import os
import socket
from contextlib import contextmanager
from typing import Iterator, Mapping, Optional

from ..config.rundir import RunDir

log = logging.getLogger(__name__)


# glibc malloc for CPU ranks: keep up to 256 MiB of freed heap for the next step and mmap only
# buffers over 32 MiB, instead of giving pages back to the kernel and faulting them in again
# every step (about 90% fewer page faults: benchmarks/cpu_runtime.md). Both or neither: a fixed
# trim threshold alone also pins the mmap threshold at 128 KiB. Not set when the user chose an
# allocator or glibc malloc settings (``_user_malloc``).
CPU_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}


_PRELOADED_ALLOCATORS = ("malloc", "hoard")  # jemalloc, tcmalloc, mimalloc, snmalloc, ...


def _user_malloc(environ: Mapping[str, str]) -> bool:
    """Whether the environment already configures the allocator (a preloaded one, glibc malloc
    variables or tunables): then it is the user's, and left alone."""
    preload = environ.get("LD_PRELOAD", "").lower()
    return (any(k.startswith("MALLOC_") for k in environ)
            or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")
            or any(a in preload for a in _PRELOADED_ALLOCATORS))


def worker_env(output_dir: str, device: str,
               environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """Environment every rank gets: quiet tokenizers, no hub access (the driver fetched what
    the ranks need), NCCL's flight recorder dumping the last collectives of a hung rank, and on
    CPU the malloc settings above (unless ``environ``, the launching one by default, has its
    own)."""
    trace = RunDir(output_dir).nccl_trace_prefix
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
           "TORCH_FR_DUMP_TEMP_FILE": trace}
    if device == "cpu":
        if _user_malloc(os.environ if environ is None else environ):
            log.info("CPU ranks keep the allocator settings of this environment (LD_PRELOAD, "
                     "MALLOC_*, GLIBC_TUNABLES) instead of llama_fsdp's %s", CPU_MALLOC_ENV)
        else:
            env.update(CPU_MALLOC_ENV)
    return env


@contextmanager
def scoped_environ(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in os.environ while the block runs (processes started in it inherit them),
    the launching process's own values back after it: a CPU run's settings must not reach a
    later run's ranks, nor look like the user's own to it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port() -> int:
    """A TCP port free on this host right now (the local rendezvous port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

