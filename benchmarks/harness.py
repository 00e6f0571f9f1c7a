"""What eval.harness costs on the CPU at the default shape: the default run's export (the tiny
Llama, 3.4M parameters, fp32) loaded and scored by lm-eval in process, each bundled task on
its 200 documents, against the run's training and the export it writes. Each measurement in
its own process (peak RSS from getrusage). Writes benchmarks/harness.md.

    .venv/bin/python benchmarks/harness.py --out benchmarks/harness.md

Why the export rather than a model gathered in memory: the in-memory path would save writing
and reading the export; the numbers below say what that is worth against the harness itself.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MEASURE = r"""
import json, resource, sys, time
from pathlib import Path
t0 = time.perf_counter()
what, export = sys.argv[1], Path(sys.argv[2])
out = {}
import transformers, torch  # imported before the clocks: a run's rank has them already
if what == "load":
    from llama_fsdp.harness import load_model
    t = time.perf_counter(); load_model(export, device="cpu"); out["load_s"] = time.perf_counter() - t
elif what == "save":
    from llama_fsdp.harness import load_model
    import tempfile
    m, tok = load_model(export, device="cpu")
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter(); m.save_pretrained(d); tok.save_pretrained(d)
        out["save_s"] = time.perf_counter() - t
else:
    from llama_fsdp import harness
    from llama_fsdp.config.schema import HarnessConfig
    t = time.perf_counter()
    r = harness.evaluate(export, HarnessConfig(tasks=[what]), device="cpu")
    out["evaluate_s"] = time.perf_counter() - t
    out["scores"] = harness.headline(r)
out["process_s"] = time.perf_counter() - t0
out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("RESULT " + json.dumps(out))
"""


def measure(what: str, export: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", MEASURE, what, str(export)], capture_output=True,
                       text=True, timeout=1800, env={**os.environ, "PYTHONPATH": str(REPO)})
    line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(line[len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "harness.md")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "llama_fsdp", "cluster.device=cpu"], cwd=cwd,
                           capture_output=True, text=True, timeout=1800,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
        train_wall = time.perf_counter() - t
        assert r.returncode == 0, r.stderr[-3000:]
        run_dir = Path(re.search(r"^\s+run dir\s+(\S+)", r.stdout + r.stderr, re.M).group(1))
        export = run_dir / "export"
        size_mb = sum(f.stat().st_size for f in export.iterdir()) / 1e6
        rows = {what: measure(what, export) for what in
                ("load", "save", "llama_fsdp_synthetic", "llama_fsdp_synthetic_mc")}
    import platform

    import torch

    lines = [
        "# eval.harness on the CPU, default shape",
        "",
        f"`python benchmarks/harness.py` on {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()}), torch {torch.__version__}: the "
        "default run (`python -m "
        "llama_fsdp`, 60 steps, 2 CPU ranks) then, each in its own process, its export "
        f"({size_mb:.1f} MB, fp32) loaded, saved again, and scored by each bundled task on "
        "all 200 documents (batch 8).",
        "",
        "| what | seconds | process peak RSS (MB) | score |",
        "|---|---|---|---|",
        f"| the default run, end to end (its training, evals, export) | {train_wall:.1f} | | |",
        f"| load the export (`from_pretrained` + tokenizer) | {rows['load']['load_s']:.2f} | "
        f"{rows['load']['peak_rss_mb']:.0f} | |",
        f"| write it again (`save_pretrained` + tokenizer) | {rows['save']['save_s']:.2f} | "
        f"{rows['save']['peak_rss_mb']:.0f} | |",
    ]
    for task in ("llama_fsdp_synthetic", "llama_fsdp_synthetic_mc"):
        row = rows[task]
        score = "; ".join(f"{k.split('/', 1)[1]} {v:.3f}" for k, v in row["scores"].items())
        lines.append(f"| lm-eval `{task}` (200 documents), load included | "
                     f"{row['evaluate_s']:.1f} | {row['peak_rss_mb']:.0f} | {score} |")
    load_save = rows["load"]["load_s"] + rows["save"]["save_s"]
    lines += [
        "",
        f"Writing and reading the export costs {load_save:.2f} s together at this size, "
        f"{100 * load_save / rows['llama_fsdp_synthetic']['evaluate_s']:.0f}% of the generation "
        f"task's harness and {100 * load_save / rows['llama_fsdp_synthetic_mc']['evaluate_s']:.0f}"
        "% of the multiple-choice one's; nearly all of it is `from_pretrained`'s fixed cost "
        "(the write is hundredths of a second). Scoring a model gathered in memory would save "
        "those seconds, once per harness. The export is kept as what is scored because it is "
        "written at the end of a run anyway (save.export_hf / finetune.export_merged), it is "
        "what `lm_eval --model hf` loads (tests/integration/test_harness.py holds the two "
        "scores equal), and a gathered model would hold a second copy of the weights beside "
        "the sharded training state on rank 0 during the run.",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
