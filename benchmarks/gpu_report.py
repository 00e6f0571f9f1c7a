"""The GPU check's results: one JSON line per result in ``$OUT/results.jsonl``, and their
markdown (``$OUT/summary.md`` while the check runs; ``benchmarks/gpu.md`` after it).

    python benchmarks/gpu_report.py outputs/gpu-check/results.jsonl --out benchmarks/gpu.md

appends the check's section to benchmarks/gpu.md (the file is made with its heading when it is
new): the device and versions, every stage and whether its time cap cut it, each run with its
command (loss, tokens/s, MFU, peak allocated and reserved against the plan), the GPU tests (peak
against the plan per configuration), throughput against the peers with the issue's goals, and
what was not run and why. Stdlib only: the check's orchestrator imports it before any
dependency is installed.

Record kinds (``kind``): ``stage`` (started, done, failed, cut, skipped), ``machine``, ``run``
(one command line of llama_fsdp), ``test`` (one GPU test), ``throughput`` (one runner of
benchmarks/throughput.py), ``skipped`` (an optional step whose feature is absent) and
``progress`` (a step starting: what a cut stage was doing).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Optional

RESULTS = "results.jsonl"
SUMMARY = "summary.md"
T0_ENV = "GPU_CHECK_T0"  # epoch seconds when the check started (set by the orchestrator)
STAGE_ENV = "GPU_CHECK_STAGE"
OUT_ENV = "GPU_CHECK_OUT"
BROKEN_ENV = "GPU_CHECK_BROKEN"  # a test run on code broken on purpose: the mutation
PLAN_TOLERANCE = 0.10  # issue 42: CUDA peak within 10% of the plan
MFU_GOAL = (0.45, 0.50)  # at least, goal: 1b, seq 2048, one H100
HF_RATIO_GOAL = 1.3  # tokens/s against HF Trainer's on the same GPU
GB = 1e9


# --- writing ---------------------------------------------------------------------------------


def append(out_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    """Append one result (flushed at once) and render summary.md again from all of them."""
    t0 = float(os.environ.get(T0_ENV, "0") or 0)
    record = {"t": round(time.time() - t0, 1) if t0 else None,
              "stage": os.environ.get(STAGE_ENV), **record}
    out_dir = Path(out_dir)
    with (out_dir / RESULTS).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")
    write_summary(out_dir)
    return record


def append_here(record: dict[str, Any]) -> dict[str, Any]:
    """``append`` into the check's output folder, named by the environment (a stage process)."""
    return append(Path(os.environ[OUT_ENV]), record)


def write_summary(out_dir: Path) -> None:
    text = render(read(Path(out_dir) / RESULTS))
    tmp = Path(out_dir) / f".{SUMMARY}.tmp"
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(Path(out_dir) / SUMMARY)


def read(path: Path) -> list[dict[str, Any]]:
    """Every record; a line cut off by a killed writer is left out."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


# --- rendering -------------------------------------------------------------------------------


def _f(value: Optional[float], fmt: str = "{:.2f}") -> str:
    return "–" if value is None else fmt.format(value)


def _pct(value: Optional[float]) -> str:
    return _f(None if value is None else value * 100, "{:.1f}%")


def _ratio(measured: Optional[float], planned: Optional[float]) -> str:
    if not measured or not planned:
        return "–"
    r = measured / planned
    mark = "" if abs(r - 1) <= PLAN_TOLERANCE else " (outside ±10%)"
    return f"{r:.3f}{mark}"


def _code(text: Optional[str]) -> str:
    return "–" if not text else "`" + str(text).replace("|", "\\|").replace("`", "'") + "`"


def _cell(text: Any) -> str:
    return "–" if text in (None, "") else str(text).replace("|", "\\|").replace("\n", " ")


def _of(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r.get("kind") == kind]


def render(records: list[dict[str, Any]], *, heading_level: int = 2) -> str:
    """The check's section: every table whose records exist."""
    h = "#" * heading_level
    machine = next(iter(_of(records, "machine")), {})
    lines = [f"{h} GPU check: {machine.get('device', 'device not recorded')}, "
             f"{machine.get('date', '')}".rstrip(", "), ""]
    lines += _machine(machine) + _stages(records, h) + _runs(records, h)
    lines += _throughput(records, h) + _profiles(records, h) + _peaks(records, h)
    lines += _tests(records, h)
    lines += _not_run(records, h)
    return "\n".join(lines).rstrip() + "\n"


def _machine(m: dict) -> list[str]:
    if not m:
        return ["The machine was not recorded (the setup stage did not finish).", ""]
    v = m.get("versions", {})
    versions = ", ".join(f"{k} {val}" for k, val in v.items())
    out = [f"- device: {m.get('device')} ({_f(m.get('memory_gb'), '{:.1f}')} GB), driver "
           f"{m.get('driver') or '–'}, CUDA {m.get('cuda') or '–'}; python {m.get('python')}",
           f"- versions: {versions}",
           f"- command: {_code(m.get('command'))}; carried wheels: {m.get('wheels') or 'none'}"]
    return out + [""]


def _stages(records: list[dict], h: str) -> list[str]:
    ends = [r for r in _of(records, "stage") if r.get("status") != "started"]
    if not ends:
        return []
    out = [f"{h}# Stages", "", "| stage | status | cap (s) | took (s) | note |",
           "|---|---|---:|---:|---|"]
    for r in ends:
        note = r.get("reason") or ""
        if r.get("running"):
            note = f"cut while running {r['running']}" + (f"; {note}" if note else "")
        out.append(f"| {r.get('stage')} | {r.get('status')} | {_f(r.get('cap_s'), '{:.0f}')} "
                   f"| {_f(r.get('elapsed_s'), '{:.0f}')} | {_cell(note)} |")
    return out + [""]


def _runs(records: list[dict], h: str) -> list[str]:
    runs = _of(records, "run")
    if not runs:
        return []
    out = [f"{h}# Runs of the command line", "",
           "| run | status | loss first → last | tokens/s | MFU | peak allocated (GB) "
           "| peak reserved (GB) | plan (GB) | allocated / plan | attention, precision, device |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in runs:
        loss = (f"{_f(r.get('loss_first'), '{:.3f}')} → {_f(r.get('loss_last'), '{:.3f}')}"
                if r.get("loss_first") is not None else "–")
        what = ", ".join(str(r[k]) for k in ("attention", "precision", "device") if r.get(k))
        status = r.get("status") + (f": {r['error']}" if r.get("error") else "")
        out.append(f"| {r.get('name')} | {_cell(status)} | {loss} "
                   f"| {_f(r.get('tokens_per_s'), '{:,.0f}')} | {_pct(r.get('mfu'))} "
                   f"| {_f(r.get('peak_allocated_gb'))} | {_f(r.get('peak_reserved_gb'))} "
                   f"| {_f(r.get('predicted_peak_gb'))} "
                   f"| {_ratio(r.get('peak_allocated_gb'), r.get('predicted_peak_gb'))} "
                   f"| {_cell(what)} |")
    out += ["", "Commands:", ""]
    out += [f"- {r.get('name')}: {_code(r.get('command'))}" for r in runs]
    return out + [""]


def _throughput(records: list[dict], h: str) -> list[str]:
    rows = _of(records, "throughput")
    if not rows:
        return []
    by = {r["runner"]: r for r in rows}
    hf, floor = by.get("hf_trainer"), by.get("bare_fsdp2")
    shape = rows[0].get("shape", "")
    out = [f"{h}# Throughput: {shape}", "",
           "| runner | what it ran | tokens/s | ms/step | MFU | vs HF Trainer | vs bare FSDP2 "
           "| steady steps |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        tps = r.get("tokens_per_s")
        vs = [_f(tps / b["tokens_per_s"], "{:.2f}x") if tps and b and b.get("tokens_per_s")
              else "–" for b in (hf, floor)]
        ran = r.get("ran") or (f"failed: {r['error']}" if r.get("error") else "–")
        out.append(f"| {r.get('label', r['runner'])} | {_cell(ran)} | {_f(tps, '{:,.0f}')} "
                   f"| {_f(r.get('ms_per_step'), '{:.1f}')} | {_pct(r.get('mfu'))} | {vs[0]} "
                   f"| {vs[1]} | {r.get('steady_steps', '–')} |")
    # the goals are judged on rows like the peers' where this check ran them
    goal = next((by[k] for k in ("llama_fsdp_one_record", "llama_fsdp") if k in by), None)
    out += [""] + _goals(goal, hf)
    out += ["Commands (`$RUN` is the run's directory):", ""]
    out += [f"- {r.get('label', r['runner'])}: {_code(r.get('command'))}" for r in rows]
    return out + [""]


PROFILE_ROWS = 12  # the ops shown per runner


def _profiles(records: list[dict], h: str) -> list[str]:
    """Where each throughput runner's step goes (benchmarks/step_clock.py's profile): the busy
    time of the device per step against the step's wall time, and the ops with the most self
    time."""
    rows = _of(records, "profile")
    if not rows:
        return []
    out = [f"{h}# Where the step goes (torch.profiler, steady steps {rows[0].get('steps_profiled')})",
           ""]
    for r in rows:
        steps = max(int(r.get("steps") or 1), 1)
        busy = r.get("total_us", 0) / steps / 1e3
        wall = r.get("step_ms")
        share = f", {busy / wall:.0%} of the {wall:.1f} ms step" if wall else ""
        out += [f"- **{r.get('label', r['runner'])}**: {r.get('device')} busy {busy:.1f} ms a "
                f"step{share}", "",
                "| op / kernel | ms a step | calls a step |", "|---|---:|---:|"]
        for op in (r.get("ops") or [])[:PROFILE_ROWS]:
            out.append(f"| {_cell(op['name'][:90])} | {op['self_us'] / steps / 1e3:.2f} "
                       f"| {op['calls'] / steps:.0f} |")
        out.append("")
    return out


def _goals(ours: Optional[dict], hf: Optional[dict]) -> list[str]:
    out = []
    if ours and ours.get("mfu") is not None:
        met = "met" if ours["mfu"] >= MFU_GOAL[0] else "not met"
        out.append(f"- judged on: {ours.get('label', ours['runner'])}")
        out.append(f"- MFU {_pct(ours['mfu'])}: at least {MFU_GOAL[0]:.0%} (goal "
                   f"{MFU_GOAL[1]:.0%}): {met}")
    if ours and hf and ours.get("tokens_per_s") and hf.get("tokens_per_s"):
        ratio = ours["tokens_per_s"] / hf["tokens_per_s"]
        met = "met" if ratio >= HF_RATIO_GOAL else "not met"
        out.append(f"- tokens/s {ratio:.2f}x HF Trainer's: at least {HF_RATIO_GOAL}x: {met}")
    return out + [""] if out else []


def _peaks(records: list[dict], h: str) -> list[str]:
    rows = [r for r in _of(records, "test") if (r.get("props") or {}).get("measured_gb")]
    if not rows:
        return []
    out = [f"{h}# CUDA peak against the plan (GPU tests)", "",
           "| configuration | measured (GB) | plan (GB) | measured / plan | peak in | test |",
           "|---|---:|---:|---:|---|---|"]
    for r in rows:
        p = r["props"]
        out.append(f"| {_cell(p.get('config'))} | {_f(p.get('measured_gb'), '{:.3f}')} "
                   f"| {_f(p.get('predicted_gb'), '{:.3f}')} "
                   f"| {_ratio(p.get('measured_gb'), p.get('predicted_gb'))} "
                   f"| {_cell(p.get('peak_phase'))} | {r.get('outcome')} |")
    return out + [""]


def _tests(records: list[dict], h: str) -> list[str]:
    rows = _of(records, "test")
    if not rows:
        return []
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.get("outcome", "?")] = counts.get(r.get("outcome", "?"), 0) + 1
    out = [f"{h}# GPU tests: " + ", ".join(f"{n} {k}" for k, n in counts.items()), "",
           "| test | outcome | s | note |", "|---|---|---:|---|"]
    for r in rows:
        props = r.get("props") or {}
        note = r.get("message") or props.get("text") or ""
        out.append(f"| `{r.get('name')}` | {r.get('outcome')} | "
                   f"{_f(r.get('duration_s'), '{:.0f}')} | {_cell(note)} |")
    return out + ["", "Each test runs as `python -m pytest -m gpu TEST`.", ""]


def _not_run(records: list[dict], h: str) -> list[str]:
    rows = _of(records, "skipped")
    if not rows:
        return []
    out = [f"{h}# Not run", ""]
    out += [f"- {r.get('name')}: {r.get('reason')} (would run {_code(r.get('command'))})"
            for r in rows]
    return out + [""]


# --- the converter ---------------------------------------------------------------------------


def convert(results: Path, out: Optional[Path]) -> str:
    """The check's section; appended to ``out`` (made with its heading when new)."""
    text = render(read(results))
    if out is None:
        return text
    head = ("# GPU measurements\n\nEach section is one run of `bash scripts/gpu_check.sh` "
            "(docs/gpu.md), converted by `python benchmarks/gpu_report.py`; the newest last.\n\n")
    existing = out.read_text(encoding="utf-8") if out.exists() else head
    if text.splitlines()[0] in existing.splitlines():
        raise SystemExit(f"{out} already has this check's section ({text.splitlines()[0]!r}): "
                         "nothing appended")
    out.write_text(existing.rstrip("\n") + "\n\n" + text, encoding="utf-8")
    return text


def main(argv: Optional[Iterable[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, help="the check's results.jsonl")
    ap.add_argument("--out", type=Path, default=None,
                    help="append the section to this file (e.g. benchmarks/gpu.md); "
                         "default: print it")
    args = ap.parse_args(None if argv is None else list(argv))
    if not args.results.is_file():
        raise SystemExit(f"{args.results}: no such file (the check writes "
                         f"$OUT/{RESULTS})")
    text = convert(args.results, args.out)
    print(text if args.out is None else f"appended to {args.out}")


if __name__ == "__main__":
    main()
