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
    loss = _frames("/r/llama_fsdp/loss.py:77:_chunk_grad", "/r/llama_fsdp/train.py:95:step")
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
        {"site": "llama_fsdp/loss.py:77:_chunk_grad", "bytes": 50, "count": 1}]
    assert [a["bytes"] for a in out["largest"]] == [300, 100, 50]
    assert out["peak_stack"][0].endswith("llama_fsdp/loss.py:77:_chunk_grad")
    assert out["largest"][0]["stack"][0].startswith("torch/nn/functional.py:10")
