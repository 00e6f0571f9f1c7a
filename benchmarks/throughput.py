"""Training throughput of llama_fsdp against a bare FSDP2 loop, HF Trainer and torchtitan.

    bash benchmarks/setup_peers.sh        # once: the peers' venv (.venv-bench)
    .venv/bin/python benchmarks/throughput.py --device cpu --ranks 2 --rounds 3 --steps 30 \
        --out benchmarks/throughput.md
    .venv/bin/python benchmarks/throughput.py --device cuda --ranks 8 --model 1b --seq-len 2048 \
        --batch-size 2 --precision mixed --framework-override data.tokenizer=/path/to/llama3

Every runner trains the same Llama shape (the framework's composed ``model`` node, read with
``python -m llama_fsdp model=NAME --cfg job``) on the same per-rank batch, sequence length and
step count: llama_fsdp through its real CLI (its synthetic packed data, eval off), the peers
on fixed-seed random tokens. Runs are interleaved, the order rotated by one each round
(round 1: A B C, round 2: B C A, ...), so that a busy machine slows every runner alike and no
runner always goes first (after the previous round's last run has just exited) or last; each
run's per-step wall time comes from rank-0 step-end stamps (benchmarks/step_clock.py), its
warm-up steps left out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import yaml
from throughput_report import Meta, Round, Summary, render, summarize, table
from throughput_runners import (
    CLOCK_HOOK,
    REPO,
    Bench,
    FrameworkRunner,
    PeerRunner,
    Runner,
    RunResult,
    execute,
)

log = logging.getLogger("throughput")

# llama_fsdp_sdpa: packed rows through SDPA's dense block mask, against auto's varlen (flash
# varlen_attn on CUDA, block-sparse SDPA on CPU)
RUNNERS_CPU = ("llama_fsdp", "bare_fsdp2", "hf_trainer", "torchtitan", "llama_fsdp_no_shard",
               "bare_fsdp2_packed", "llama_fsdp_unpacked", "llama_fsdp_sdpa",
               "llama_fsdp_no_shard_lora", "hf_trainer_peft", "llama_fsdp_no_shard_foreach",
               "llama_fsdp_no_shard_full_loss")
RUNNERS_CUDA = RUNNERS_CPU + ("hf_trainer_ddp",)
ALL_RUNNERS = RUNNERS_CUDA
# the adapters' rank in the LoRA pair (the tiny recipe's), alpha twice it
LORA_RANK = 16
# --runners trainer: both comparisons with the HF Trainer in one call (DDP against DDP: on the
# CPU, Trainer's FSDP request falls back to DDP; on CUDA hf_trainer_ddp asks for it)
PRESETS = {"trainer": {"cpu": ("llama_fsdp_no_shard", "hf_trainer", "llama_fsdp_no_shard_lora",
                               "hf_trainer_peft"),
                       "cuda": ("llama_fsdp_no_shard", "hf_trainer_ddp",
                                "llama_fsdp_no_shard_lora", "hf_trainer_peft")}}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--ranks", type=int, default=2, help="ranks (GPUs) on this host")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of each run")
    ap.add_argument("--model", default="tiny", help="a conf/model option: tiny, 1b, 3b, 8b, ...")
    ap.add_argument("--batch-size", type=int, default=8, help="per-rank micro-batch")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--precision", choices=("fp32", "mixed", "bf16"), default="fp32")
    ap.add_argument("--runners", default=None,
                    help=f"comma-separated subset of {', '.join(ALL_RUNNERS)} "
                         "(default: all; hf_trainer_ddp on cuda only), or 'trainer': no_shard "
                         "and LoRA against the HF Trainer and Trainer + PEFT")
    ap.add_argument("--framework-override", action="append", default=[],
                    help="extra llama_fsdp override, e.g. data.tokenizer=DIR (repeatable)")
    ap.add_argument("--bench-venv", type=Path, default=REPO / ".venv-bench")
    ap.add_argument("--run-timeout", type=float, default=900, help="seconds per run")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="run directories (default outputs/benchmarks/throughput-<time>)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "throughput.md")
    args = ap.parse_args()
    if args.steps < args.warmup + 3:
        ap.error(f"--steps must be at least --warmup + 3 ({args.warmup + 3})")
    return args


def compose(main_python: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    """The framework's composed job config (Hydra's --cfg job): nothing is launched."""
    return subprocess.run([str(main_python), "-m", "llama_fsdp", *overrides, "--cfg", "job"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


def probe_framework(main_python: Path, model: str, extra: list[str]) -> tuple[dict, bool]:
    """The model node to benchmark, and whether ``train.callbacks`` is accepted yet."""
    base = [f"model={model}", *extra]
    with_clock = compose(main_python, [*base, f'train.callbacks=["{CLOCK_HOOK}"]'])
    if with_clock.returncode == 0:
        return yaml.safe_load(with_clock.stdout)["model"], True
    plain = compose(main_python, base)
    if plain.returncode != 0:
        raise SystemExit(f"llama_fsdp cannot compose model={model}:\n{plain.stderr}")
    log.warning("llama_fsdp does not accept train.callbacks yet (%s): timing it from its "
                "MLflow step_time_s history instead", with_clock.stderr.strip().splitlines()[0])
    return yaml.safe_load(plain.stdout)["model"], False


def build_runners(bench: Bench, keys: list[str], clock: bool,
                  more: Optional[dict[str, Callable[[], Runner]]] = None) -> list[Runner]:
    """The runners ``keys`` names, from this table and the caller's ``more`` (runners that need
    what only the caller has, e.g. a data file it wrote)."""
    def peer(key: str, label: str, module: str, *extra: str, diagnostic: bool = False
             ) -> PeerRunner:
        return PeerRunner(bench, key=key, label=label, module=f"benchmarks.peers.{module}",
                          extra=extra, diagnostic=diagnostic)

    factories = {
        "llama_fsdp": lambda: FrameworkRunner(bench, sharding="full", clock=clock),
        "bare_fsdp2": lambda: peer("bare_fsdp2", "bare FSDP2 loop (floor)", "bare_fsdp"),
        "hf_trainer": lambda: peer("hf_trainer", "HF Trainer, FSDP2 requested", "hf_trainer"),
        "torchtitan": lambda: peer("torchtitan", "torchtitan (llama3, custom flavor)", "titan"),
        "llama_fsdp_no_shard": lambda: FrameworkRunner(bench, sharding="no_shard", clock=clock),
        "bare_fsdp2_packed": lambda: peer(
            "bare_fsdp2_packed", "bare FSDP2 loop + packed position_ids", "bare_fsdp",
            "--packed", diagnostic=True),
        "llama_fsdp_unpacked": lambda: FrameworkRunner(bench, sharding="full", clock=clock,
                                                       packing=False),
        "hf_trainer_ddp": lambda: peer("hf_trainer_ddp", "HF Trainer, DDP requested",
                                       "hf_trainer", "--sharding", "no_shard"),
        # LoRA against Trainer + PEFT: the same rank, alpha and seven projections, DDP both
        "llama_fsdp_no_shard_lora": lambda: FrameworkRunner(
            bench, sharding="no_shard", clock=clock, name="lora",
            what=f"finetune=lora, rank {LORA_RANK}",
            options=("finetune=lora", f"finetune.rank={LORA_RANK}",
                     f"finetune.alpha={2 * LORA_RANK}")),
        # the CPU's AdamW before optim.fused=null meant fused there too: its cost in a step
        "llama_fsdp_no_shard_foreach": lambda: FrameworkRunner(
            bench, sharding="no_shard", clock=clock, name="foreach",
            options=("optim.fused=false",)),
        # the loss over the whole vocabulary at once, as the peers compute it (the default
        # head is the chunked one)
        "llama_fsdp_no_shard_full_loss": lambda: FrameworkRunner(
            bench, sharding="no_shard", clock=clock, name="full_loss",
            options=("train.loss=full",)),
        "hf_trainer_peft": lambda: peer(
            "hf_trainer_peft", f"HF Trainer + PEFT LoRA rank {LORA_RANK}", "hf_trainer",
            "--sharding", "no_shard", "--lora-rank", str(LORA_RANK),
            "--lora-alpha", str(2 * LORA_RANK)),
        "llama_fsdp_sdpa": lambda: FrameworkRunner(bench, sharding="full", clock=clock,
                                                   attention="sdpa"),
        # what torchtitan runs on CUDA: the layers compiled, the fused AdamW step
        "llama_fsdp_compile": lambda: FrameworkRunner(bench, sharding="full", clock=clock,
                                                      options=("train.compile=true",)),
        "llama_fsdp_fused": lambda: FrameworkRunner(bench, sharding="full", clock=clock,
                                                    options=("optim.fused=true",)),
        "llama_fsdp_compile_fused": lambda: FrameworkRunner(
            bench, sharding="full", clock=clock,
            options=("train.compile=true", "optim.fused=true")),
        # transformers' flex_attention over the packed rows (a document mask from the
        # position_ids), compiled: on the H200 4.7x faster than flash varlen on rows of tiny
        # records (benchmarks/gpu.md); CUDA only (no flex backward on the CPU)
        "llama_fsdp_flex": lambda: FrameworkRunner(
            bench, sharding="full", clock=clock, name="flex",
            options=("model.attn_implementation=flex_attention", "train.compile=true")),
    }
    factories.update(more or {})
    return [factories[k]() for k in keys]


def rotated(items: list[Any], k: int) -> list[Any]:
    """``items`` starting at index ``k`` (mod its length), wrapping around."""
    k %= max(len(items), 1)
    return items[k:] + items[:k]


def run_rounds(runners: list[Runner], rounds: int, work_dir: Path,
               timeout_s: float) -> tuple[dict[str, list[RunResult]], list[Round]]:
    """Round r runs every runner once, the order rotated by r - 1, so that every runner takes
    every place in the order equally often (over a multiple of that many rounds). A runner that
    has only failed so far (it cannot run here) is not tried again and leaves the rotation; one
    that ran before is (a failure can be passing)."""
    results: dict[str, list[RunResult]] = {r.key: [] for r in runners}
    done = []
    for round_no in range(1, rounds + 1):
        start, load = time.monotonic(), os.getloadavg()[0]
        alive = [r for r in runners
                 if not results[r.key] or any(res.ok for res in results[r.key])]
        for runner in rotated(alive, round_no - 1):
            log.info("round %d/%d: %s", round_no, rounds, runner.label)
            res = execute(runner, work_dir / f"round{round_no}" / runner.key,
                          round_no=round_no, timeout_s=timeout_s)
            log.info("  %s in %.0f s", "ok" if res.ok else f"FAILED: {res.error}", res.elapsed_s)
            results[runner.key].append(res)
        done.append(Round(seconds=time.monotonic() - start, load=load))
    return results, done


def versions(python: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json\n"
            "def v(n):\n"
            "    try: return m.version(n)\n"
            "    except m.PackageNotFoundError: return 'not installed'\n"
            "print(json.dumps({n: v(n) for n in "
            "('torch', 'transformers', 'accelerate', 'peft', 'torchtitan', 'triton')}))")
    if not python.exists():
        return {"torch": f"{python} missing: run benchmarks/setup_peers.sh"}
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def device_text(device: str, ranks: int) -> str:
    if device == "cuda":
        import torch

        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} (using {ranks})"
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                  .splitlines() if line.startswith("model name")), platform.processor())
    return f"CPU: {model}, {os.cpu_count()} cores (gloo)"


def titan_generation(version: str) -> str | None:
    """The torchtitan generation (``"0.2"``, ``"0.3"``) of an installed version, or None."""
    return None if version == "not installed" else ".".join(version.split(".")[:2])


def titan_note(bench: Bench, gen: str | None) -> str:
    if gen == "0.3":
        return ("torchtitan 0.3 has no SDPA for language models, so it runs flex attention, "
                "with its spmd_types backend and, on NVIDIA GPUs, CUDA-graph capture of "
                "forward+backward.")
    if gen == "0.2":
        text = ("torchtitan 0.2 runs SDPA with a causal mask, the transformers runners' kernel; "
                "its llama3 has no weight tying, so a tied shape trains a separate output "
                "matrix (vocab x hidden more parameters, the same FLOPs).")
        if bench.device == "cpu":
            text += (" torchtitan picks `cuda` when no accelerator is present; on CPU the "
                     "runner points that choice at the CPU (gloo, a memory monitor that reports "
                     "nothing) and has its FSDP units reduce gradients with SUM instead of "
                     "PREMUL_SUM(1.0), which gloo lacks (the same sum: torchtitan divides by "
                     "the global token count itself); its loop is otherwise unchanged "
                     "(benchmarks/peers/titan.py).")
        return text
    return "torchtitan is not installed in the bench venv."


def notes(bench: Bench, summaries: list[Summary], clock: bool, titan_version: str) -> list[str]:
    gen = titan_generation(titan_version)
    out = [
        ("llama_fsdp runs on its own synthetic instruction data with packing (several records "
         "per row, position_ids restarting per record, so transformers builds a block-causal "
         "attention mask instead of the plain causal path), prompt tokens masked from the loss; "
         "the peers use fixed-seed random tokens, every token a target. Same shapes, same "
         "tokens per step. The diagnostic `bare FSDP2 loop + packed position_ids` is the floor "
         "loop fed position_ids that restart every 4-12 tokens (the synthetic records' "
         "lengths): the cost of that mask alone."),
        ("The bare loop has no gradient clipping, LR schedule, metrics or progress display; "
         "whatever llama_fsdp does per step beyond forward, backward and AdamW (global "
         "target-token count, DTensor-aware clipping, schedule, its metrics and their "
         "collectives, the data loader) is what the ratio column prices. The "
         "`data.packing=false` row runs the framework on one record per row (no restarting "
         "position_ids, so the plain causal attention path): its ratio is the loop's own "
         "overhead."),
        ("HF Trainer: `fsdp=True, fsdp_config={fsdp_version: 2, transformer_layer_cls_to_wrap: "
         "[LlamaDecoderLayer], reshard_after_forward: true}` (the non-deprecated spelling of "
         "`fsdp=\"full_shard auto_wrap\"`); the `what it ran` column is read from the trained "
         "model (FSDPModule units / DistributedDataParallel), not assumed."),
        ("torchtitan: the shape is registered as a llama3 flavor (its model, its "
         "parallelize_llama FSDP2, its loop, its other defaults). " + titan_note(bench, gen)),
    ]
    if not clock:
        out.append("FALLBACK in force: this llama_fsdp has no `train.callbacks` yet, so its "
                   "stamps are the millisecond timestamps MLflow gives each step's metrics "
                   "(tracking on, into a private sqlite store per run); rerun once "
                   "`train.callbacks` exists, the harness switches by itself.")
    if bench.device == "cpu":
        out.append("llama_fsdp's CPU ranks run with the glibc malloc settings its launchers "
                   "give them (`MALLOC_MMAP_THRESHOLD_` 32 MiB, `MALLOC_TRIM_THRESHOLD_` 256 MiB: "
                   "launchers/environment.py), the peers with glibc's defaults, as each is launched "
                   "for its users. Measured on this shape, the settings take rank 0's page "
                   "faults from 3,100-4,200 to 280-460 per step and its system time from 33-38 "
                   "to 24-31 ms per step, about 1.5% of a step.")
    titan = next((s for s in summaries if s.runner.key == "torchtitan"), None)
    if titan and titan.error and bench.device == "cpu" and gen == "0.3":
        out.append("torchtitan 0.3 picks its device as `torch._utils._get_available_device_type() "
                   "or \"cuda\"` (torchtitan/tools/utils.py), so on a CPU-only machine it calls "
                   "`torch.cuda.set_device` and stops. Forced onto CPU by hand (device patched, "
                   "`spmd_backend=partial_dtensor`), it builds this flavor with exactly the "
                   "transformers model's parameter count and then stops at the first backward: "
                   "`NotImplementedError: FlexAttention does not support backward on CPU` (it "
                   "has no SDPA). torchtitan 0.2.2 runs here: `TORCHTITAN=0.2.2 bash "
                   "benchmarks/setup_peers.sh`.")
    return out


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM unwinds like Ctrl-C, so the run in progress is killed with the benchmark."""
    raise SystemExit(128 + signum)


def select_runners(args: argparse.Namespace, bench: Bench, clock: bool) -> list[Runner]:
    keys = args.runners.split(",") if args.runners else list(
        RUNNERS_CUDA if args.device == "cuda" else RUNNERS_CPU)
    if args.runners in PRESETS:
        keys = list(PRESETS[args.runners][args.device])
    unknown = set(keys) - set(ALL_RUNNERS)
    if unknown:
        raise SystemExit(f"unknown runner(s) {sorted(unknown)}: valid: {', '.join(ALL_RUNNERS)}")
    runners = build_runners(bench, keys, clock)
    if any(isinstance(r, PeerRunner) for r in runners) and not bench.bench_python.exists():
        raise SystemExit(f"{bench.bench_python} is missing: run bash benchmarks/setup_peers.sh")
    return runners


def _repo_relative(path: str | Path) -> str:
    return str(path).replace(str(REPO) + "/", "")


def meta_for(args: argparse.Namespace, bench: Bench, summaries: list[Summary], shape: dict,
             rounds: list[Round], clock: bool, work_dir: Path) -> Meta:
    peers = versions(bench.bench_python)
    titan = peers.get("torchtitan", "not installed")
    return Meta(device=device_text(args.device, args.ranks),
                versions={".venv": versions(bench.main_python), args.bench_venv.name: peers},
                shape=shape, rounds=rounds, date=f"{datetime.datetime.now():%Y-%m-%d %H:%M}",
                argv=shlex.join([_repo_relative(bench.main_python),
                                 *map(_repo_relative, sys.argv)]),
                work_dir=_repo_relative(work_dir), notes=notes(bench, summaries, clock, titan))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = parse_args()
    main_python = Path(sys.executable)  # not resolved: the venv's python, not its target
    work_dir = (args.work_dir or REPO / "outputs" / "benchmarks"
                / f"throughput-{datetime.datetime.now():%Y%m%d-%H%M%S}").resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    shape, clock = probe_framework(main_python, args.model, args.framework_override)
    shape_file = work_dir / "shape.json"
    shape_file.write_text(json.dumps(shape, indent=2))
    bench = Bench(device=args.device, ranks=args.ranks, model=args.model,
                  batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps,
                  warmup=args.warmup, precision=args.precision, main_python=main_python,
                  bench_python=args.bench_venv.absolute() / "bin" / "python",
                  shape_file=shape_file, framework_overrides=tuple(args.framework_override))
    runners = select_runners(args, bench, clock)
    results, rounds = run_rounds(runners, args.rounds, work_dir, args.run_timeout)
    summaries = [summarize(r, results[r.key], args.warmup) for r in runners]
    meta = meta_for(args, bench, summaries, shape, rounds, clock, work_dir)
    args.out.write_text(render(bench, summaries, meta))
    base = next((s for s in summaries if s.runner.key == "bare_fsdp2"), None)
    print("\n".join(table(summaries, base, bench, "bare_fsdp2")))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
