"""benchmarks/long_context.md's plan table: issue 40's scenarios (QLoRA on 24 GB cards, micro-batch
1, full activation checkpointing) with the full loss (what every plan was before the chunked
loss), the chunked loss (the default) and the chunked loss with the layer inputs offloaded:
predicted peak per GPU, its phase, pinned host RAM per rank and the longest train.seq_len that
fits (on a node with ``HOST_GB`` of RAM for the offloaded runs).

    .venv/bin/python benchmarks/long_context.py            # prints the table's rows
    .venv/bin/python benchmarks/long_context.py --measure  # and the CPU measurement

``--measure``: issue 40's CPU case (the tiny model's layers with a 65,536-token vocabulary,
seq 2048, micro-batch 2, 2 gloo ranks, fp32) with each loss, measured as
benchmarks/plan_vs_measured.py measures (the malloc shim's heap peak of step 2, per rank)
against the plan.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

HOST_GB = 128  # RAM of the node for the offloaded runs (cluster.mem_gb, shared by its ranks)
SCENARIOS = [("8b", 1, 8192), ("8b", 1, 16384), ("8b", 1, 32768), ("8b", 1, 65536),
             ("70b", 4, 2048), ("70b", 4, 8192), ("70b", 4, 16384)]
PATHS = {"full loss": ["train.loss=full"], "chunked": [],
         "chunked + offload": ["checkpointing.offload=true"],
         "chunks of 256 + offload": ["checkpointing.offload=true", "train.loss_chunk=256"]}


def overrides(model: str, gpus: int, seq_len: int) -> list[str]:
    return [f"model={model}", "finetune=qlora", "cluster=slurm", f"cluster.gpus_per_node={gpus}",
            "cluster.gpu_type=rtx4090", f"cluster.mem_gb={HOST_GB}", "cluster.timeout_min=60",
            f"train.seq_len={seq_len}", "train.batch_size=1", "checkpointing=full",
            "dry_run=true"]


def rows() -> list[str]:
    from llama_fsdp.plan import GB, make_plan
    from tests.conftest import make_spec

    out = []
    for model, gpus, seq_len in SCENARIOS:
        cells = []
        for extra in PATHS.values():
            spec = make_spec([*overrides(model, gpus, seq_len), "cluster.device=cuda", *extra],
                             output_dir="/tmp/llama_fsdp_longctx")
            p = make_plan(spec)
            verdict = "" if p.fits else (" (host RAM)" if p.device_fits else " (refused)")
            host = p.memory.host_activations / GB
            cells.append(f"{p.predicted_peak_gb:.2f} {p.peak_phase}{verdict}"
                         + (f", host {host:.1f}" if host else "") + f" | {p.longest_seq_len:,}")
        out.append(f"| {model} QLoRA, {gpus} x RTX 4090, seq {seq_len:,} | " + " | ".join(cells)
                   + " |")
    return out


MEASURED = ["tracking.enabled=false", "cluster.device=cpu", "cluster.nproc_per_node=2",
            "precision=fp32", "train.batch_size=2", "train.seq_len=2048",
            "model.vocab_size=65536", "data.packing=false"]


def measure() -> list[str]:
    """Measured and planned peak per rank of MEASURED with each loss."""
    from benchmarks import plan_vs_measured as B
    from llama_fsdp.plan import make_plan
    from tests.conftest import make_spec
    from tests.distributed import run_ranks

    lib = B.build_memtrack()
    if lib is None:
        raise SystemExit("needs a C compiler (cc) on Linux to build the malloc shim")
    specs = {loss: make_spec([*MEASURED, f"train.loss={loss}"],
                             output_dir="/tmp/llama_fsdp_longctx")
             for loss in ("full", "chunked")}
    with B.preloaded(lib):
        results = run_ranks(B.measure_on_rank, 2, specs, 2, timeout=3600)
    out = []
    for loss, spec in specs.items():
        plan = make_plan(spec)
        measured = max(B.peak_of(r[loss]) for r in results)
        out.append(f"| {loss} | {plan.predicted_peak_bytes / 1e9:.3f} ({plan.peak_phase}) | "
                   f"{measured / 1e9:.3f} | {measured / plan.predicted_peak_bytes:.3f} | "
                   f"{plan.memory.logits_loss / 1e9:.3f} |")
    return out


if __name__ == "__main__":
    print("\n".join(rows()))
    if "--measure" in sys.argv:
        print("\n".join(measure()))
