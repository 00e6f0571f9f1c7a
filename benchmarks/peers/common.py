"""What the peer runners share: arguments, the Llama config, process setup, random batches.

The peers are started by torchrun (one process per rank) from benchmarks/throughput.py and
never import llama_fsdp: the model shape arrives as JSON (the framework's composed ``model``
node), so every runner trains the same transformers ``LlamaForCausalLM`` layout.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import LlamaConfig

PRECISIONS = ("fp32", "mixed", "bf16")


def parse_args(description: str,
               extra: dict[str, dict[str, Any]] | None = None) -> argparse.Namespace:
    """The arguments every peer takes (plus runner-specific ``extra`` options)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--shape", type=Path, required=True, help="model node as JSON")
    ap.add_argument("--batch-size", type=int, required=True, help="per-rank micro-batch")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--precision", choices=PRECISIONS, default="fp32")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--info", type=Path, required=True, help="rank 0 writes what it ran here")
    for flag, kwargs in (extra or {}).items():
        ap.add_argument(flag, **kwargs)
    return ap.parse_args()


def load_shape(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def llama_config(shape: dict[str, Any]) -> LlamaConfig:
    """The transformers config of a composed ``model`` node (as llama_fsdp builds it)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(shape["rope_theta"])}
    if shape.get("rope_scaling"):
        rs = shape["rope_scaling"]
        rope = {"rope_type": rs["rope_type"], "rope_theta": float(shape["rope_theta"]),
                "factor": float(rs["factor"]), "low_freq_factor": float(rs["low_freq_factor"]),
                "high_freq_factor": float(rs["high_freq_factor"]),
                "original_max_position_embeddings": int(rs["original_max_position_embeddings"])}
    cfg = LlamaConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
        max_position_embeddings=shape["max_position_embeddings"],
        rms_norm_eps=shape["rms_norm_eps"], tie_word_embeddings=shape["tie_word_embeddings"],
        rope_parameters=rope, initializer_range=shape.get("init_std", 0.02), use_cache=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    # the peers run transformers' own kernels: llama_fsdp's "auto" and "varlen" (its flash
    # over packed records, llama_fsdp/model/attention.py) are not theirs; they get SDPA
    attn = shape.get("attn_implementation", "sdpa")
    cfg._attn_implementation = "sdpa" if attn in ("auto", "varlen") else attn
    return cfg


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world: int
    device: torch.device


def threads_per_rank() -> int:
    """Cores split evenly between this host's ranks, as llama_fsdp does on CPU."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // local_world)


def init_distributed(device_type: str) -> Dist:
    """gloo on CPU, nccl on CUDA; torchrun provides RANK/LOCAL_RANK/WORLD_SIZE."""
    torch.set_num_threads(threads_per_rank())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return Dist(dist.get_rank(), local_rank, dist.get_world_size(), device)


def random_tokens(n: int, *, batch: int, seq_len: int, vocab: int, seed: int,
                  device: torch.device) -> list[torch.Tensor]:
    """``n`` fixed-seed batches of ``seq_len + 1`` tokens (inputs plus the shifted targets)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (batch, seq_len + 1), generator=gen).to(device) for _ in range(n)]


def packed_positions(batch: int, seq_len: int, lengths: tuple[int, int],
                     gen: torch.Generator) -> torch.Tensor:
    """position_ids [batch, seq_len] that restart at every record boundary, as packed rows'
    do; record lengths drawn uniformly from ``lengths`` (inclusive)."""
    rows = []
    for _ in range(batch):
        parts, filled = [], 0
        while filled < seq_len:
            n = int(torch.randint(lengths[0], lengths[1] + 1, (), generator=gen))
            parts.append(torch.arange(min(n, seq_len - filled)))
            filled += len(parts[-1])
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def write_info(path: Path, rank: int, info: dict[str, Any]) -> None:
    """Rank 0 records what actually ran (wrapping, dtypes, parameter count) for the report."""
    if rank == 0:
        path.write_text(json.dumps(info, indent=2))
