"""Per-rank memory of full fine-tuning, LoRA and QLoRA on CPU gloo ranks, measured next to the
plan: the tiny shape and Llama 3.2 1B's.

Measured as benchmarks/plan_vs_measured.py measures (its malloc shim, LD_PRELOADed: the heap's
high-water mark of each phase of the second training step, above the heap before the model was
built, less what stays after teardown, plus the state tensors below the shim's 64 KiB blocks);
predicted by ``make_plan(spec).predicted_peak_bytes``. 2 ranks, full sharding, micro-batch 1,
seq 256, full activation checkpointing; rank 16 on all 7 projections.

    .venv/bin/python benchmarks/finetune_memory.py --out benchmarks/finetune_memory_cpu.md
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import plan_vs_measured as B  # noqa: E402

GB = 10**9
METHODS = ("full", "lora", "qlora")
# model -> precision (bf16 for 1b: 8 bytes per trained parameter keeps full fine-tuning's two
# ranks within this machine's RAM)
MODELS = {"tiny": "fp32", "1b": "bf16"}


def overrides(model: str, method: str, precision: str) -> list[str]:
    return ["tracking.enabled=false", "cluster.device=cpu", "cluster.nproc_per_node=2",
            f"model={model}", f"finetune={method}", f"precision={precision}",
            "checkpointing=full", "train.batch_size=1", "train.seq_len=256",
            "data.packing=false", "model.attn_implementation=sdpa"]


def _on_rank(rank: int, world: int, specs: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    # the tiny shape is warmed up (the math libraries' caches in the baseline); at 1b's size
    # those few MB are noise and a warm-up step would double the time
    return {name: B.measure_case(spec, rank, 2, warm=spec.model.name == "tiny")
            for name, spec in specs.items()}


def measure(models: list[str], lib: Path) -> list[dict]:
    from llama_fsdp.plan import make_plan
    from tests.conftest import make_spec
    from tests.distributed import run_ranks

    rows = []
    for model in models:
        specs = {m: make_spec(overrides(model, m, MODELS[model]),
                              output_dir="/tmp/llama_fsdp_ftmem") for m in METHODS}
        t0 = time.perf_counter()
        with B.preloaded(lib):
            results = run_ranks(_on_rank, 2, specs, timeout=3600)
        for method, spec in specs.items():
            per_rank = [r[method] for r in results]
            best = max(per_rank, key=B.peak_of)
            plan = make_plan(spec)
            rows.append({"model": model, "method": method, "plan": plan,
                         "measured": B.peak_of(best),
                         "start": best["steps"][-1]["start"] - best["end"] + best["small"],
                         "seconds": time.perf_counter() - t0})
            print(f"{model} {method}: measured {rows[-1]['measured'] / GB:.4f} GB, predicted "
                  f"{plan.predicted_peak_bytes / GB:.4f} GB", flush=True)
    return rows


def markdown(rows: list[dict], command: str) -> str:
    from llama_fsdp.plan.lora import adapter_params
    from llama_fsdp.plan.shapes import count_params

    lines = [
        "# Full fine-tuning, LoRA and QLoRA: memory per rank on CPU gloo ranks",
        "",
        f"Produced by `{command}` (torch 2.13 CPU build, torchao 0.18, 2 cores). 2 ranks, "
        "full sharding, micro-batch 1, seq 256, full activation checkpointing, unpacked rows; "
        "lora / qlora: rank 16 on all 7 projections. The method of measuring is "
        "benchmarks/plan_vs_measured.py's (a malloc shim's heap high-water mark of step 2's "
        "phases). GB = 1e9 bytes.",
        "",
        "- *state*: parameters + optimizer state at the start of step 2, measured / planned "
        "(`memory.params + memory.optimizer`).",
        "- *peak*: the highest phase of step 2, measured / planned "
        "(`predicted_peak_bytes`).",
        "",
        "| model | precision | method | trainable | state GB (measured / plan) "
        "| peak GB (measured / plan) | measured / plan | peak phase |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["plan"]
        spec = p.spec
        trainable = (adapter_params(spec.model, spec.finetune) if spec.finetune.adapters
                     else count_params(spec.model))
        state = p.memory.params + p.memory.optimizer
        lines.append(
            f"| {r['model']} | {spec.precision.name} | {r['method']} | {trainable:,} | "
            f"{r['start'] / GB:.4f} / {state / GB:.4f} | {r['measured'] / GB:.4f} / "
            f"{p.predicted_peak_bytes / GB:.4f} | {r['measured'] / p.predicted_peak_bytes:.3f} "
            f"| {p.peak_phase} |")
    lines += [
        "",
        "- The state (the frozen base, NF4 with its scales, the adapters and their AdamW moments, "
        "or every weight with its moments) is what the plan counts, to 0.1%.",
        "- 1b (vocab 128256, tied embedding): lora and qlora peak at the start of the forward, "
        "where the tied root is all-gathered (its output buffer beside the copied-out "
        "parameters) while the first layers are prefetched; full fine-tuning at the end of "
        "backward (the root's gradient and its reduce-scatter).",
        "- tiny (vocab 512): the logits are small and the peak is inside a layer's backward, "
        "where the plan counts the whole recomputed layer beside the prefetched layers and "
        "(qlora) the dequantized weight, although backward frees the recomputed activations as "
        "it goes: the plan is 14-22% above there, on the safe side.",
    ]
    by = {(r["model"], r["method"]): r["measured"] for r in rows}
    for model in dict.fromkeys(r["model"] for r in rows):
        full = by.get((model, "full"))
        if full:
            lines += ["", f"{model}: lora peaks at {by[(model, 'lora')] / full:.0%} of full "
                      f"fine-tuning's measured peak, qlora at "
                      f"{by[(model, 'qlora')] / full:.0%}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,1b")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    lib = B.build_memtrack()
    if lib is None:
        sys.exit("needs a C compiler (cc) on Linux to build the malloc shim")
    t0 = time.perf_counter()
    rows = measure(args.models.split(","), lib)
    command = "python benchmarks/finetune_memory.py" + (f" --out {args.out}" if args.out else "")
    text = markdown(rows, command) + f"\nWall time: {time.perf_counter() - t0:.0f} s.\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
