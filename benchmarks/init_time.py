"""Random-init cost per rank: the shard-by-shard draw (llama_fsdp.model.llama.init_weights) against
drawing each full tensor on every rank and scattering it (what init did before; kept here as
the reference). Same FSDP2 model on N gloo ranks (CPU), same values either way for any N.

    .venv/bin/python benchmarks/init_time.py --model 1b --ranks 2 --out benchmarks/init_time.md
"""
from __future__ import annotations

import argparse
import math
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _full_draw_init(model, *, std: float, seed: int) -> None:
    """The previous init: one generator, every full tensor drawn in order, then distributed."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator(device="cpu").manual_seed(seed)
    n_layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                full = torch.ones(p.shape)
            else:
                s = std / math.sqrt(2 * n_layers) if name.endswith(("o_proj.weight",
                                                                     "down_proj.weight")) else std
                full = torch.randn(p.shape, generator=gen) * s
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
            else:
                p.copy_(full)


def _rank(rank: int, world: int, model_name: str, how: str) -> dict:
    import torch.distributed as dist

    from llama_fsdp.model.llama import build_meta_model, decoder_layers, init_weights
    from llama_fsdp.model.parallelize import build_mesh, parallelize
    from tests.conftest import make_spec

    spec = make_spec([f"model={model_name}", "cluster.device=cpu",
                      f"cluster.nproc_per_node={world}"])
    model = build_meta_model(spec.model)
    parallelize(model, decoder_layers(model), mesh=build_mesh(spec.mesh, "cpu"),
                mesh_spec=spec.mesh, policy=spec.policy, ac=spec.checkpointing,
                compile=False, cpu_offload=False)
    model.to_empty(device="cpu")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dist.barrier()
    t0 = time.perf_counter()
    (init_weights if how == "shards" else _full_draw_init)(model, std=spec.model.init_std,
                                                           seed=spec.train.seed)
    seconds = time.perf_counter() - t0
    dist.barrier()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "peak_rss_growth_gb": (rss1 - rss0) / 2**20}


def main() -> None:
    from tests.distributed import run_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1b")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    for how in ("full", "shards", "full", "shards"):  # interleaved
        res = run_ranks(_rank, args.ranks, args.model, how, timeout=1800)
        rows.append((how, max(r["seconds"] for r in res),
                     max(r["peak_rss_growth_gb"] for r in res)))
        print(rows[-1], flush=True)
    import torch

    lines = [f"# Random init per rank: model={args.model}, {args.ranks} gloo ranks (CPU)", "",
             f"torch {torch.__version__}; command: `.venv/bin/python benchmarks/init_time.py "
             f"--model {args.model} --ranks {args.ranks} --out {args.out}`", "",
             "| init | seconds (slowest rank) | peak RSS growth during init, GB (max rank) |",
             "|---|---|---|"]
    names = {"full": "full tensor drawn on every rank, then scattered (before)",
             "shards": "each rank draws only its shard's row blocks (now)"}
    for how, s, g in rows:
        lines.append(f"| {names[how]} | {s:.2f} | {g:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
