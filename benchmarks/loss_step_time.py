"""CPU step time of the loss paths (train.loss=chunked | full), as a ratio in one run.

Two real gloo ranks build the model once per loss path (worker.build_model, the run's own
path), then run the same micro-batches through ``train.train_step``, alternating the paths in
rounds (a few steps of each, then again), so that load from other processes on this shared
machine falls on both alike. Rank 0's wall time and process CPU time per step are recorded;
the ratio of the medians is the result. Shapes: the default command's (tiny model, batch 8 x
128, fp32) and the same layers with Llama 3's 128,256-token vocabulary.

    .venv/bin/python benchmarks/loss_step_time.py --out benchmarks/long_context_steptime.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BASE = ["tracking.enabled=false", "eval.every_steps=0", "cluster.nproc_per_node=2",
        "data.packing=false"]
SHAPES = {"default (vocab 512)": [], "vocab 32768": ["model.vocab_size=32768"]}


def _batches(spec, rank: int, n: int) -> list[list[dict]]:
    import torch

    t = spec.train
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(n):
        ids = torch.randint(0, spec.model.vocab_size, (t.batch_size, t.seq_len), generator=gen)
        labels = ids.clone()
        labels[:, : t.seq_len // 4] = -100  # a prompt's worth of masked tokens per row
        out.append([{"input_ids": ids, "labels": labels}])
    return out


def time_on_rank(rank: int, world: int, specs: dict, rounds: int, per_round: int) -> dict:
    """Per path: rank 0's wall and CPU seconds of every timed step."""
    import torch

    from llama_fsdp.train.optimizer import build_optimizer
    from llama_fsdp.train.loop import build_scheduler, train_step
    from llama_fsdp.train.worker import build_model

    torch.set_num_threads(1)
    device = torch.device("cpu")
    built = {}
    for name, spec in specs.items():
        model = build_model(spec, device)
        opt = build_optimizer(model, spec.train, spec.optim)
        built[name] = (model, opt, build_scheduler(opt, spec.train))
    batches = _batches(next(iter(specs.values())), rank, per_round)
    times: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in specs}
    for r in range(rounds + 1):  # round 0 warms every path up, untimed
        for name, (model, opt, sched) in built.items():
            for micro in batches:
                w0, c0 = time.perf_counter(), time.process_time()
                train_step(model, opt, sched, micro, device=device,
                           max_grad_norm=specs[name].train.max_grad_norm)
                if r:
                    times[name]["wall"].append(time.perf_counter() - w0)
                    times[name]["cpu"].append(time.process_time() - c0)
    return times


def measure(paths: dict[str, list[str]], shape: list[str], *, rounds: int,
            per_round: int) -> dict:
    from tests.conftest import make_spec
    from tests.distributed import run_ranks

    specs = {name: make_spec([*BASE, *shape, *extra], output_dir="/tmp/llama_fsdp_losstime")
             for name, extra in paths.items()}
    return run_ranks(time_on_rank, 2, specs, rounds, per_round, timeout=3600)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--paths", default="full,chunked",
                    help="train.loss values to time (comma-separated)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--per-round", type=int, default=5)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    paths = {p: [f"train.loss={p}"] if p != "plain" else [] for p in a.paths.split(",")}
    report = {}
    for label, shape in SHAPES.items():
        times = measure(paths, shape, rounds=a.rounds, per_round=a.per_round)
        row = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
        report[label] = {"median_s": row, "raw": times}
        line = ", ".join(f"{n}: {r['wall'] * 1e3:.1f} ms wall, {r['cpu'] * 1e3:.1f} ms CPU"
                         for n, r in row.items())
        print(f"{label}: {line}")
        if "full" in row and "chunked" in row:
            print(f"  chunked / full: wall {row['chunked']['wall'] / row['full']['wall']:.3f}, "
                  f"CPU {row['chunked']['cpu'] / row['full']['cpu']:.3f}")
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
