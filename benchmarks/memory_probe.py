"""Where a CUDA run's peak goes: a ``train.callbacks`` hook that records the caching allocator's
history (``torch.cuda.memory._record_memory_history``, Python stacks) over step
``$MEMORY_PROBE_STEP`` (default 2: the first with optimizer state), from the end of the step
before, and then replays that history to its highest point and writes the allocations live there,
grouped by the line of llama_fsdp / transformers / torchao / peft that made them, to the JSON
file ``$MEMORY_PROBE_OUT``. For a plan that misses a CUDA peak (benchmarks/gpu.md), this says
which tensors the plan does not count.

    MEMORY_PROBE_OUT=probe.json python -m llama_fsdp ... \
        'train.callbacks=["benchmarks.memory_probe:MemoryProbe"]'

The replay's bytes are those above what was allocated when the step began
(``allocated_at_step_start``: weights, optimizer state). Rank 0 only; a CPU run is not probed.
``peak_sites`` is plain Python over the snapshot's trace, so it is tested without a GPU
(tests/unit/test_memory_probe.py).
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

OUT_ENV, STEP_ENV = "MEMORY_PROBE_OUT", "MEMORY_PROBE_STEP"
MAX_ENTRIES = 300_000
# a frame in one of these is where an allocation "comes from" (the innermost such frame)
OURS = ("llama_fsdp/", "transformers/", "torchao/", "peft/", "benchmarks/")
TOP = 30


def _site(frames: list[dict[str, Any]]) -> str:
    """The innermost frame of our code or a library we call, as file:line:function (the
    innermost frame of any kind where none matches)."""
    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in OURS):
            short = name[max(name.rfind(k) for k in OURS if k in name):]
            return f"{short}:{f.get('line')}:{f.get('name')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename', '?')}:{f.get('line')}:{f.get('name')}"
    return "(no stack)"


def _stack(frames: list[dict[str, Any]], n: int = 8) -> list[str]:
    out = []
    for f in frames:
        name = f.get("filename", "")
        if name.endswith((".cpp", ".h", ".cu")) or name == "??":
            continue
        out.append(f"{name.split('site-packages/')[-1]}:{f.get('line')}:{f.get('name')}")
        if len(out) == n:
            break
    return out


def peak_sites(trace: Iterable[dict[str, Any]], top: int = TOP) -> dict[str, Any]:
    """Replay an allocator trace (alloc / free_completed events): its highest point above the
    trace's start, the allocations live there grouped by site (largest first), the largest
    ones with their stacks, and the stack of the allocation that made the peak."""
    events = list(trace)
    live: dict[int, dict[str, Any]] = {}
    cur = peak = 0
    peak_at = -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > peak:
                peak, peak_at = cur, i
        elif e["action"] in ("free_completed",) and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    live = {}
    for e in events[:peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in live.values():
        g = groups[_site(e.get("frames", []))]
        g[0] += e["size"]
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    largest = sorted(live.values(), key=lambda e: -e["size"])[:top]
    return {
        "peak_bytes": peak, "events": len(events), "peak_event": peak_at,
        "live_at_peak": len(live),
        "sites": [{"site": s, "bytes": b, "count": c} for s, (b, c) in ranked[:top]],
        "largest": [{"bytes": e["size"], "stack": _stack(e.get("frames", []))} for e in largest],
        "peak_stack": _stack(events[peak_at].get("frames", []), 16) if peak_at >= 0 else [],
    }


class MemoryProbe:
    """The ``train.callbacks`` factory and hook: recording starts at the end of the step before
    ``$MEMORY_PROBE_STEP``, the report is written at the end of that step."""

    def __init__(self, rank: int = 0, world_size: int = 1, output_dir: Any = None):
        import torch

        self.on = rank == 0 and torch.cuda.is_available() and bool(os.environ.get(OUT_ENV))
        self.step = max(1, int(os.environ.get(STEP_ENV, 2)))
        self.base = 0
        if self.on and self.step == 1:
            self._start()

    def _start(self) -> None:
        import torch

        torch.cuda.synchronize()
        self.base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")

    def __call__(self, state: Any) -> None:
        if not self.on:
            return
        if state.step == self.step - 1:
            self._start()
        if state.step != self.step:
            return
        import torch

        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        self.on = False
        trace = snap["device_traces"][torch.cuda.current_device()]
        report = {"step": self.step, "allocated_at_step_start": self.base,
                  "max_allocated_in_step": torch.cuda.max_memory_allocated(),
                  **peak_sites(trace)}
        Path(os.environ[OUT_ENV]).write_text(json.dumps(report, indent=1))
