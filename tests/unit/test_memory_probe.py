"""benchmarks/memory_probe.py's replay of a CUDA allocator trace (the GPU's hook itself runs
only on a GPU): the peak is the highest point of allocated bytes, and the allocations live
there are grouped by the innermost frame of our code or a library we call."""
from __future__ import annotations

from benchmarks.memory_probe import peak_sites


def _frames(*where: str) -> list[dict]:
    out = []
    for w in where:
        name, line, fn = w.split(":")
        out.append({"filename": name, "line": int(line), "name": fn})
    return out


def test_the_replay_finds_the_peak_and_groups_what_is_live_there_by_our_frame():
    mlp = _frames("/usr/lib/python3/site-packages/torch/nn/functional.py:10:silu",
                  "/x/site-packages/transformers/models/llama/modeling_llama.py:150:forward",
                  "/r/llama_fsdp/train.py:90:train_step")
    loss = _frames("/r/llama_fsdp/objective/loss.py:77:_chunk_grad", "/r/llama_fsdp/train/loop.py:95:step")
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": mlp},
        {"action": "alloc", "addr": 2, "size": 300, "frames": mlp},
        {"action": "free_requested", "addr": 1, "size": 100},  # still allocated until completed
        {"action": "alloc", "addr": 3, "size": 50, "frames": loss},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 2, "size": 300},
        {"action": "alloc", "addr": 4, "size": 200, "frames": loss},  # 250 live: below the peak
    ]
    out = peak_sites(trace)
    assert out["peak_bytes"] == 450 and out["peak_event"] == 3 and out["live_at_peak"] == 3
    assert out["sites"] == [
        {"site": "transformers/models/llama/modeling_llama.py:150:forward", "bytes": 400,
         "count": 2},
        {"site": "llama_fsdp/objective/loss.py:77:_chunk_grad", "bytes": 50, "count": 1}]
    assert [a["bytes"] for a in out["largest"]] == [300, 100, 50]
    assert out["peak_stack"][0].endswith("llama_fsdp/objective/loss.py:77:_chunk_grad")
    assert out["largest"][0]["stack"][0].startswith("torch/nn/functional.py:10")


def test_the_attention_benchmark_rehearses_on_the_cpu(tmp_path):
    """benchmarks/attention_gpu.py (the GPU session's kernel comparison) runs end to end on the
    CPU with a small shape: a timed line per kernel that exists there, for each kind of row,
    and the kernels that cannot run there (flex's backward) say why instead of failing."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    out = tmp_path / "attention.jsonl"
    subprocess.run([sys.executable, "benchmarks/attention_gpu.py", "--out", str(out),
                    "--device", "cpu"], cwd=REPO, check=True, capture_output=True, timeout=300)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    timed = {(r["kind"], r["kernel"]) for r in rows if r.get("ms", 0) > 0}
    assert {("one", "sdpa_causal"), ("one", "sdpa_mask"), ("r256", "sdpa_mask"),
            ("synthetic", "sdpa_mask")} <= timed, rows
    synthetic = next(r for r in rows if r["kind"] == "synthetic" and "records" in r)
    assert synthetic["records"] > 20  # rows of many 4-12-token records
    assert all("error" in r for r in rows if r["kernel"] == "flex"), rows
