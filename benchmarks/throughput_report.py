"""Medians, ratios and the markdown report of benchmarks/throughput.py."""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from step_clock import step_walls
from throughput_runners import Bench, Runner, RunResult

BASELINE = "bare_fsdp2"


@dataclass
class Summary:
    """One runner over all rounds: pooled steady-step walls (and rank-0 CPU seconds) and the
    per-round wall medians."""

    runner: Runner
    walls: list[float]
    cpu: list[float]
    round_medians: list[float]
    info: dict[str, Any]
    failures: list[tuple[int, str]]  # (round, reason) of every failed run
    # (round, reason) of every run that stamped all its steps and then exited abnormally
    exit_failures: list[tuple[int, str]] = field(default_factory=list)

    @property
    def error(self) -> str | None:
        """Why the runner cannot run here: set only when none of its runs succeeded."""
        return self.failures[0][1] if self.failures and not self.walls else None

    @property
    def median(self) -> float | None:
        return statistics.median(self.walls) if self.walls else None

    @property
    def cpu_median(self) -> float | None:
        return statistics.median(self.cpu) if self.cpu else None


def summarize(runner: Runner, results: list[RunResult], warmup: int) -> Summary:
    ok = [r for r in results if r.ok]
    per_round = [step_walls(r.stamps, warmup=warmup) for r in ok]
    walls = [w for ws in per_round for w in ws]
    cpu = [c for r in ok for c in step_walls(r.cpu_stamps, warmup=warmup)]
    failures = [(r.round, r.error or "") for r in results if not r.ok]
    info = ok[-1].info if ok else {}
    exits = [(r.round, r.exit_error) for r in ok if r.exit_error]
    return Summary(runner, walls, cpu, [statistics.median(ws) for ws in per_round if ws], info,
                   failures, exits)


@dataclass
class Round:
    seconds: float
    load: float  # 1-minute load average when the round started: how busy the machine was


@dataclass
class Meta:
    """What the report says besides the numbers."""

    device: str
    versions: dict[str, dict[str, str]]
    shape: dict[str, Any]
    rounds: list[Round]
    date: str
    argv: str
    work_dir: str
    notes: list[str]


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.1f}"


def _spread(s: Summary) -> str:
    if not s.round_medians:
        return "–"
    return f"{min(s.round_medians) * 1000:.1f}–{max(s.round_medians) * 1000:.1f}"


def _ratio(value: float | None, base: float | None) -> str:
    return "–" if value is None or base is None else f"{value / base:.3f}"


def table(rows: list[Summary], base: Summary | None, bench: Bench, base_name: str) -> list[str]:
    """One line per runner: median s/step, spread over rounds, global tokens/s, ratio, and
    rank 0's CPU time per step with its ratio (the load-robust view of the same work)."""
    header = (f"| runner | what it ran | median ms/step | round medians (ms) | tokens/s (global) "
              f"| s/step vs {base_name} | rank-0 CPU ms/step | CPU vs {base_name} "
              "| steady steps |")
    out = [header, "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in rows:
        tps = "–" if s.median is None else f"{bench.tokens_per_step / s.median:,.0f}"
        ran = s.info.get("ran", "cannot run here" if s.error else "–")
        wall = _ratio(s.median, base.median if base else None)
        cpu = _ratio(s.cpu_median, base.cpu_median if base else None)
        out.append(f"| {s.runner.label} | {ran} | {_ms(s.median)} | {_spread(s)} | {tps} "
                   f"| {wall} | {_ms(s.cpu_median)} | {cpu} | {len(s.walls)} |")
    return out


def by_key(summaries: list[Summary]) -> dict[str, Summary]:
    return {s.runner.key: s for s in summaries}


def no_shard_pair(summaries: list[Summary]) -> list[Summary]:
    """llama_fsdp no_shard against the HF Trainer run that is DDP (hf_trainer_ddp if there)."""
    keys = by_key(summaries)
    hf = keys.get("hf_trainer_ddp") or keys.get("hf_trainer")
    return [s for s in (keys.get("llama_fsdp_no_shard"), hf) if s is not None]


def lora_pair(summaries: list[Summary]) -> list[Summary]:
    """llama_fsdp finetune=lora (no_shard) against HF Trainer + PEFT LoRA (DDP)."""
    keys = by_key(summaries)
    return [s for s in (keys.get("llama_fsdp_no_shard_lora"), keys.get("hf_trainer_peft"))
            if s is not None]


# runners reported only in their pair's own section
PAIRED_ONLY = ("hf_trainer_ddp", "llama_fsdp_no_shard_lora", "hf_trainer_peft")


def render(bench: Bench, summaries: list[Summary], meta: Meta) -> str:
    keys = by_key(summaries)
    base = keys.get(BASELINE)
    main = [s for s in summaries if not s.runner.diagnostic and s.runner.key not in PAIRED_ONLY]
    diagnostics = [s for s in summaries
                   if s.runner.diagnostic and s.runner.key not in PAIRED_ONLY]
    pair, lora = no_shard_pair(summaries), lora_pair(summaries)
    lines = ["# Throughput: llama_fsdp against a bare FSDP2 loop, HF Trainer and torchtitan", "",
             f"Measured {meta.date} with `{meta.argv}`.", ""]
    lines += _setup(bench, meta, base)
    lines += ["## Results", "", *table(main, base, bench, BASELINE), ""]
    if diagnostics:
        context = [s for s in (base, keys.get("llama_fsdp")) if s is not None]
        lines += ["## Diagnostics: where the gap to the floor comes from", "",
                  *table(context + diagnostics, base, bench, BASELINE), ""]
    if pair:
        hf = pair[-1] if len(pair) == 2 else None
        lines += ["## no_shard: llama_fsdp sharding=no_shard against HF Trainer (DDP)", "",
                  *table(pair, hf, bench, "HF Trainer"), ""]
    if lora:
        peft = lora[-1] if len(lora) == 2 else None
        lines += ["## LoRA: llama_fsdp finetune=lora (no_shard) against HF Trainer + PEFT (DDP)",
                  "", *table(lora, peft, bench, "Trainer + PEFT"), ""]
    lines += _failures(summaries) + _timing(summaries) + _versions(meta) + _commands(summaries)
    lines += ["## Notes", "", *[f"- {n}" for n in meta.notes], ""]
    lines += [f"Run directories (logs, stamps, shape.json): `{meta.work_dir}`.", ""]
    return "\n".join(lines)


def _setup(bench: Bench, meta: Meta, base: Summary | None) -> list[str]:
    threads = (f", {bench.threads_per_rank} torch thread(s) per rank"
               if bench.device == "cpu" else "")
    params = (f", {base.info['parameters']:,} parameters"
              if base and "parameters" in base.info else "")
    return [
        "## Setup", "",
        f"- device: {meta.device}; {bench.ranks} ranks{threads}",
        f"- model: `{bench.model}` ({_shape_text(meta.shape)}){params}",
        (f"- per-rank batch {bench.batch_size} x seq {bench.seq_len} = {bench.tokens_per_step:,} "
         f"tokens per optimizer step (global), precision `{bench.precision}`"),
        (f"- {len(meta.rounds)} interleaved round(s) (every runner once per round, the order rotated by one each round), "
         f"{bench.steps} steps per run; the first {bench.warmup} steps of each run are warm-up "
         "and left out"),
        ("- per-step wall = difference of consecutive rank-0 step-end stamps (`time.time()` "
         "on the CPU; on GPUs a CUDA event per step, no per-step synchronize); the tables give the median over all steady steps "
         "of all rounds, and the spread of the per-round medians; rank-0 CPU ms/step is the "
         "median per-step difference of rank 0's process CPU time (all threads), which load "
         "from other processes moves less than the wall time, though not to nothing (shared "
         "caches and cores)"),
        f"- one round took {_round_text(meta.rounds)} (process start-up included)",
        *_noise(base),
        *_load_caveat(bench, meta.rounds),
        "",
    ]


def _noise(base: Summary | None) -> list[str]:
    """How far apart the floor's own rounds are: ratios nearer 1 than that are not resolved."""
    if base is None or len(base.round_medians) < 2 or base.median is None:
        return []
    half = (max(base.round_medians) - min(base.round_medians)) / 2 / base.median
    return [(f"- noise: the floor's per-round median wall times lie within ±{half:.0%} of its "
             "overall median; a wall ratio nearer 1 than that is not resolved by this run")]


def _load_caveat(bench: Bench, rounds: list[Round]) -> list[str]:
    """Say so when other processes competed for the cores: then wall times mostly measure them."""
    cores = os.cpu_count() or 1
    if bench.device != "cpu" or not rounds or max(r.load for r in rounds) <= cores + 1:
        return []
    peak = max(r.load for r in rounds)
    return [(f"- **the machine was busy**: the load average at round starts reached {peak:.1f} "
             f"on {cores} cores (this benchmark's own ranks make about {bench.ranks}), so other "
             "processes took CPU from the ranks. Wall times are inflated and spread widely; the "
             "rank-0 CPU columns are the steadier comparison of the work each runner does")]


def _shape_text(shape: dict[str, Any]) -> str:
    tied = "tied" if shape["tie_word_embeddings"] else "untied"
    return (f"hidden {shape['hidden_size']}, {shape['num_layers']} layers, {shape['num_heads']} "
            f"heads / {shape['num_kv_heads']} KV, intermediate {shape['intermediate_size']}, "
            f"vocab {shape['vocab_size']}, {tied} embeddings")


def _round_text(rounds: list[Round]) -> str:
    if not rounds:
        return "–"
    each = ", ".join(f"{r.seconds:.0f} s at load {r.load:.1f}" for r in rounds)
    return f"{statistics.mean(r.seconds for r in rounds):.0f} s on average ({each})"


def _failures(summaries: list[Summary]) -> list[str]:
    """Runners that never ran (cannot run here), then single failed runs of the others."""
    out = []
    never = [s for s in summaries if s.error]
    if never:
        out += ["## Cannot run here", "", *[f"- **{s.runner.label}**: `{s.error}`" for s in never],
                ""]
    flaky = [(s, failure) for s in summaries if not s.error for failure in s.failures]
    if flaky:
        out += ["## Failed runs (left out of the medians)", "",
                *[f"- {s.runner.label}, round {n}: `{why}`" for s, (n, why) in flaky], ""]
    exits = [(s, failure) for s in summaries for failure in s.exit_failures]
    if exits:
        out += ["## Runs that failed after their last step (kept in the medians)", "",
                "Every step was stamped before the process ended abnormally (teardown), so "
                "the steps are timed as in any other run.", "",
                *[f"- {s.runner.label}, round {n}: `{why}`" for s, (n, why) in exits], ""]
    return out


def _timing(summaries: list[Summary]) -> list[str]:
    out = ["## How each runner was timed", ""]
    for s in summaries:
        inner = s.info.get("inner_step_time_s")
        extra = (f"; its own `step_time_s` (train step only) median "
                 f"{_ms(statistics.median(inner))} ms" if inner else "")
        out.append(f"- {s.runner.label}: {s.runner.timing}{extra}")
    return out + [""]


def _versions(meta: Meta) -> list[str]:
    names = list(next(iter(meta.versions.values())))
    out = ["## Versions", "", "| venv | " + " | ".join(names) + " |",
           "|---|" + "---|" * len(names)]
    out += [f"| `{venv}` | " + " | ".join(v.get(n, "–") for n in names) + " |"
            for venv, v in meta.versions.items()]
    return out + [""]


def _commands(summaries: list[Summary]) -> list[str]:
    out = ["## Commands (one run; `$RUN` is the run's directory)", ""]
    for s in summaries:
        out += [f"{s.runner.label}:", "", "```bash", s.runner.shown_command(), "```", ""]
    return out
