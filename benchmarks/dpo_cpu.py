"""DPO against SFT on CPU gloo ranks, on the same preference pairs: step time as a ratio in one
run, and each config's peak heap against the plan.

Step time: two real gloo ranks build every config once (the run's own pieces: data, model,
the DPO reference, loss), then run steps in rounds, alternating the configs (a few steps of
each, then again), so that load from other processes on this shared machine falls on all of
them alike. A step's time is what run_loop times: assembling its micro-batches (for dpo with
the reference's forward) and train.train_step. Rank 0's wall time per step; the medians.

- ``sft, chosen``: SFT on prompt + chosen answer, packed: the pairs as an SFT user has them
  (one sequence a pair: half the tokens);
- ``sft, same rows``: SFT's loss over the DPO rows (both answers targets: the same tokens);
- ``dpo``: the reference live (lora: the policy with its adapters off, a no_grad forward per
  micro-batch; full: the frozen copy);
- ``dpo, cached``: the reference's log-probs read from the batches (objective.reference=cached).

Peak: each config in fresh rank processes with plan_vs_measured.py's malloc shim (heap blocks
of 64 KiB and more: torch's tensors and gloo's buffers): the data is built first, then the
heap is read, the run built and one step taken (the optimizer state made), then the high-water
mark of two more steps above that first reading, less what the runtime keeps once the model is
gone (MKL / oneDNN / gloo), against ``make_plan(spec).predicted_peak_bytes``.

    .venv/bin/python benchmarks/dpo_cpu.py --out benchmarks/dpo_cpu.md
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BASE = ["tracking.enabled=false", "cluster.device=cpu", "cluster.nproc_per_node=2",
        "eval.every_steps=0", "train.max_steps=1000", "train.warmup_steps=1",
        "data.num_records=4000"]
# the default command's shape (tiny, vocab 512, rows of 8 x 128), and plan_vs_measured.py's
# (its tiny layers with vocab 8192, rows of 4 x 256)
SHAPES = {"default": []}  # (the synthetic pairs' tokenizer has 512 pieces: the tiny vocabulary)
TIMED = ("sft, chosen", "sft, same rows", "dpo", "dpo, cached")
MEMORY = {"lora": ["finetune=lora"], "full": ["finetune=full"]}


def _specs(shape: list[str], method: list[str]) -> dict:
    from tests.conftest import make_spec

    out = "/tmp/llama_fsdp_dpo_bench"
    dpo = [*BASE, *shape, *method, "objective=dpo"]
    return {"sft": make_spec([*BASE, *shape, *method], output_dir=out),
            "dpo": make_spec(dpo, output_dir=out),
            "dpo, cached": make_spec([*dpo, "objective.reference=cached"], output_dir=out)}


def _chosen_rows(data):
    """The pairs' chosen sequences alone, packed into rows (SFT on the chosen answers)."""
    import numpy as np

    from llama_fsdp.data.packing import Packed, pack

    tr = data.train
    rows = pack(tr.store.lengths[0::2], tr.seq_len)
    ptr = np.zeros(len(rows) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(r) for r in rows])
    docs = np.fromiter((2 * p for r in rows for p in r), dtype=np.int64, count=int(ptr[-1]))
    return Packed(tr.store, ptr, docs, tr.seq_len, tr.pad_id)


def _rows_forever(packed, micro: int, rank: int, world: int):
    import numpy as np

    order, i = np.random.default_rng(0).permutation(len(packed)), 0
    while True:
        if i + micro * world > len(order):
            i = 0
        yield packed.batch(order[i + rank * micro:i + (rank + 1) * micro])
        i += micro * world


def _sft_keys(it):
    for b in it:
        yield {k: b[k] for k in ("input_ids", "labels", "position_ids")}


def _build(specs: dict, rank: int, world: int) -> dict:
    """name -> (model, optimizer, scheduler, batches, loss_fn, grad_accum); every config reads
    the same pairs (the dpo spec's data), each through a data module of its own."""
    import torch

    from llama_fsdp.data import build_data
    from llama_fsdp.objective.dpo import build as build_preference
    from llama_fsdp.train.optimizer import build_optimizer
    from llama_fsdp.objective.sft import TOKEN_LOSS
    from llama_fsdp.train.loop import build_scheduler
    from llama_fsdp.train.worker import build_model

    cpu, out = torch.device("cpu"), {}
    mb = specs["dpo"].train.batch_size
    for name in TIMED:
        spec = specs["sft" if name.startswith("sft") else name]
        data = build_data(spec.data, **specs["dpo"].data_kwargs(dp_rank=rank, announce=False))
        torch.manual_seed(spec.train.seed)
        model = build_model(spec, cpu)
        loss_fn = TOKEN_LOSS
        if name == "sft, chosen":
            batches = _rows_forever(_chosen_rows(data), mb, rank, world)
        elif name == "sft, same rows":
            batches = _sft_keys(data.train_batches())
        else:
            pref = build_preference(spec, model, data, cpu, rank=rank, world=world,
                                    resuming=False)
            batches, loss_fn = pref.batches(data.train_batches()), pref.loss
        opt = build_optimizer(model, spec.train, spec.optim)
        out[name] = (model, opt, build_scheduler(opt, spec.train), batches, loss_fn,
                     spec.train.grad_accum)
    return out


def _step(model, opt, sched, batches, loss_fn, accum) -> tuple[float, int]:
    import torch

    from llama_fsdp.train.loop import train_step

    t0 = time.perf_counter()
    micro = [next(batches) for _ in range(accum)]
    res = train_step(model, opt, sched, micro, device=torch.device("cpu"), max_grad_norm=1.0,
                     loss_fn=loss_fn)
    return time.perf_counter() - t0, res.tokens


def time_on_rank(rank: int, world: int, specs: dict, rounds: int, per_round: int) -> dict:
    """Per config: rank 0's seconds and tokens of every timed step."""
    import torch

    torch.set_num_threads(1)
    built = _build(specs, rank, world)
    times: dict = {n: {"s": [], "tokens": []} for n in built}
    for r in range(rounds + 1):  # round 0 warms every config up, untimed
        for name, parts in built.items():
            for _ in range(per_round):
                dt, tokens = _step(*parts)
                if r:
                    times[name]["s"].append(dt)
                    times[name]["tokens"].append(tokens)
    return times


def peak_on_rank(rank: int, world: int, spec) -> dict:
    """One config's heap high-water mark over steps 2-3, above the heap before the model."""
    import torch

    from benchmarks.plan_vs_measured import Heap, small_state_bytes
    from llama_fsdp.data import build_data
    from llama_fsdp.train.optimizer import build_optimizer
    from llama_fsdp.objective.sft import TOKEN_LOSS
    from llama_fsdp.train.loop import build_scheduler
    from llama_fsdp.train.worker import build_model

    torch.set_num_threads(1)
    cpu, heap = torch.device("cpu"), Heap()
    data = build_data(spec.data, **spec.data_kwargs(dp_rank=rank, announce=False))
    gc.collect()
    base = heap.current()
    model = build_model(spec, cpu)
    loss_fn, batches = TOKEN_LOSS, data.train_batches()
    if spec.objective.name == "dpo":
        from llama_fsdp.objective.dpo import build as build_preference

        pref = build_preference(spec, model, data, cpu, rank=rank, world=world, resuming=False)
        loss_fn, batches = pref.loss, pref.batches(batches)
    opt = build_optimizer(model, spec.train, spec.optim)
    sched = build_scheduler(opt, spec.train)
    _step(model, opt, sched, batches, loss_fn, spec.train.grad_accum)
    heap.take_peak()
    for _ in range(2):
        _step(model, opt, sched, batches, loss_fn, spec.train.grad_accum)
    peak = heap.take_peak() - base
    small = small_state_bytes(model, opt)
    del model, opt, sched, batches, loss_fn
    if spec.objective.name == "dpo":
        del pref
    gc.collect()
    return {"peak": peak + small - (heap.current() - base), "overhead": heap.current() - base}


def timing(shape: list[str], rounds: int, per_round: int) -> dict:
    from tests.distributed import run_ranks

    specs = _specs(shape, MEMORY["lora"])
    times = run_ranks(time_on_rank, 2, specs, rounds, per_round, timeout=3600)[0]
    return {n: {"median_s": statistics.median(t["s"]), "tokens": t["tokens"][0],
                "steps": len(t["s"])} for n, t in times.items()}


def peaks(shape: list[str]) -> list[dict]:
    from benchmarks.plan_vs_measured import build_memtrack, preloaded
    from llama_fsdp.plan import make_plan
    from tests.distributed import run_ranks

    lib = build_memtrack()
    if lib is None:
        sys.exit("needs a C compiler (cc) on Linux to build the malloc shim")
    rows = []
    for method, extra in MEMORY.items():
        specs = _specs(shape, extra)
        for name in ("sft", "dpo", "dpo, cached"):
            spec = specs[name]
            with preloaded(lib):
                per_rank = run_ranks(peak_on_rank, 2, spec, timeout=1800)
            plan = make_plan(spec)
            rows.append({"name": f"{name}, {method}", "measured": max(r["peak"] for r in per_rank),
                         "overhead": max(r["overhead"] for r in per_rank),
                         "predicted": plan.predicted_peak_bytes, "phase": plan.peak_phase})
            print(rows[-1], flush=True)
    return rows


def markdown(timed: dict, mem: dict, command: str, seconds: float) -> str:
    lines = ["# DPO against SFT on CPU: step time and peak memory", "",
             f"Produced by `{command}` (torch 2.13 CPU build, 2 gloo ranks on a shared 2-core "
             "machine, one thread each; the method is in the script's docstring). LoRA rank 16 "
             "on all 7 projections, fp32, synthetic pairs (4000), packed rows.", ""]
    for shape, rows in timed.items():
        sft = rows["sft, chosen"]["median_s"]
        lines += [f"## Step time, {shape}", "",
                  "| config | median s / step | tokens / step | x sft, chosen | x sft, same rows |",
                  "|---|---|---|---|---|"]
        for name, r in rows.items():
            lines.append(f"| {name} | {r['median_s']:.4f} | {r['tokens']} | "
                         f"{r['median_s'] / sft:.2f} | "
                         f"{r['median_s'] / rows['sft, same rows']['median_s']:.2f} |")
        lines.append("")
    for shape, rows in mem.items():
        lines += [f"## Peak heap per rank against the plan, {shape}", "",
                  "| config | measured MB | predicted MB | measured / predicted | plan's peak "
                  "phase | ovh MB |", "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['name']} | {r['measured'] / 1e6:.2f} | "
                         f"{r['predicted'] / 1e6:.2f} | {r['measured'] / r['predicted']:.3f} | "
                         f"{r['phase']} | {r['overhead'] / 1e6:.1f} |")
        lines.append("")
    lines.append(f"Wall time: {seconds:.0f} s.")
    return "\n".join(lines) + "\n"


def main() -> None:
    import os

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--per-round", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    timed, mem = {}, {}
    for shape in a.shapes.split(","):
        timed[shape] = timing(SHAPES[shape], a.rounds, a.per_round)
        print(shape, timed[shape], flush=True)
        if not a.no_memory:
            mem[shape] = peaks(SHAPES[shape])
    command = (f"python benchmarks/dpo_cpu.py --rounds {a.rounds} --per-round {a.per_round}"
               + (f" --shapes {a.shapes}" if a.shapes != ",".join(SHAPES) else "")
               + (" --no-memory" if a.no_memory else "") + (f" --out {a.out}" if a.out else ""))
    text = markdown(timed, mem, command, time.perf_counter() - t0)
    if a.out:
        a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
