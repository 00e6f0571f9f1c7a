"""Run a function on N real gloo ranks (separate processes) and collect what each returns.

Each rank runs `fn(rank, world_size, *args)` after `init_process_group("gloo")`; a failure on any
rank is re-raised in the test with that rank's traceback, and hung ranks are killed.

Ranks are forked from a multiprocessing forkserver that has imported torch, transformers and
llama_fsdp once per pytest process (PRELOAD), instead of each spawned rank importing them again
(about 3 s of CPU a rank on this 2-core machine, 20-odd process groups in the suite). Each rank
still starts from a process that has run nothing but imports, with the caller's environment of
the moment applied (the server's own is the one it started with). A caller with LD_PRELOAD set
(the memory test's malloc shim, which must be in the process from exec) gets spawned ranks.
"""
from __future__ import annotations

import contextlib
import os
import traceback
from typing import Any, Callable, Iterator

import torch.multiprocessing as mp

from llama_fsdp.launchers.environment import free_port
from llama_fsdp.launchers.process import skip_final_collection

# what every rank imports anyway; the forkserver imports them once
PRELOAD = ["torch", "torch.distributed", "transformers", "llama_fsdp.train.worker", "tests.distributed"]


def _entry(fn, rank, world_size, port, args, queue, environ) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        queue.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        skip_final_collection()


def _context():
    if os.environ.get("LD_PRELOAD"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call)
    return ctx


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300) -> list[Any]:
    """Return [result of rank 0, ..., result of rank N-1]; `fn` must be importable (module level)."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, queue, environ))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


@contextlib.contextmanager
def recorded_grad_norms() -> Iterator[list[float]]:
    """In a rank process: the gradient norm this rank computes itself at every optimizer step
    (llama_fsdp.train.loop's clip_grad_norm, before any reduction of logged metrics), appended to
    the list this yields. What a rank logs is rank 0's norm; this is each rank's own."""
    from llama_fsdp.train import loop as train

    original, seen = train.clip_grad_norm, []

    def clip(params, max_norm):
        norm = original(params, max_norm)
        seen.append(float(norm))
        return norm

    train.clip_grad_norm = clip
    try:
        yield seen
    finally:
        train.clip_grad_norm = original


def trained_parts(model) -> dict[str, tuple[int, Any]]:
    """In a rank process: this rank's part of every trainable parameter after training, as it
    computed it alone (its own reduce-scattered gradient, its own optimizer step), copied to
    numpy: (the part's first row in the whole tensor, its rows). A plain tensor (one rank, or a
    replica) is all of its rows."""
    from llama_fsdp.model.lora import local_rows

    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            local = p.to_local() if hasattr(p, "to_local") else p
            key = name.replace("._checkpoint_wrapped_module", "")  # the same name under AC
            out[key] = (local_rows(p)[0], local.detach().float().numpy().copy())
    return out


def assert_rows_match(parts: dict, whole: dict, *, rtol: float, atol: float, msg: str) -> None:
    """Every part of one rank (``trained_parts``) equals the same rows of the whole tensors of
    another run (``trained_parts`` of one rank, or of a replica, whose parts are whole)."""
    import torch

    assert parts and parts.keys() == whole.keys(), msg
    for name, (start, rows) in parts.items():
        first, full = whole[name]
        assert first == 0 and len(full) >= start + len(rows), (msg, name)
        torch.testing.assert_close(torch.from_numpy(rows),
                                   torch.from_numpy(full[start:start + len(rows)]),
                                   rtol=rtol, atol=atol, msg=lambda m: f"{msg}, {name}: {m}")
