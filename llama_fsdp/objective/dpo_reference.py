"""DPO's reference model: the log-probs the policy's are compared with (llama_fsdp/objective/dpo.py).

Where they come from (objective.reference):

- ``model`` with adapters (finetune=lora / qlora): the policy itself with its adapters off
  (``adapters_disabled``), under no_grad: the frozen base, which is what the adapters started
  from (B = 0). Nothing is added to memory.
- ``model`` with full fine-tuning: ``frozen_copy``, the initial weights again (model.path, or the
  same seeded init) in the compute dtype, sharded like the policy (FSDP2 per decoder layer, the
  embedding and [norm, head] apart), every unit resharded after its forward, no gradients, no
  optimizer state, in no checkpoint (it is rebuilt from the same source on resume).
- ``cached``: the reference's summed log-prob of every sequence of both splits, computed once by
  the ranks together before the first step (``cached_logps``) and kept beside the tokenized data
  under cache_dir/reference/, keyed by the tokenized data (source, tokenizer, seq_len), the
  weights it starts from and the compute dtype. No reference sits in memory while training;
  batches carry the cached values (data.preference.PairPacked.ref_logps).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..model.attention import model_inputs
from ..config.schema import TrainConfig
from ..model.lora import lora_modules
from .loss import install as install_loss_head
from .loss import packed_sequence_logprobs
from ..config.manifest import cached_entry_ok, write_manifest
from ..run.spec import RunSpec

log = logging.getLogger(__name__)

REFERENCE_DIR = "reference"  # under cache_dir
SPLITS = ("train", "eval")


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The model without its LoRA adapters for the block: the frozen base."""
    modules = [m for _, m in lora_modules(model)]
    for m in modules:
        m.disabled = True
    try:
        yield
    finally:
        for m in modules:
            m.disabled = False


class LiveReference:
    """Reference log-probs computed by a model in memory, batch by batch (no_grad): the policy
    with its adapters off, or a frozen copy."""

    def __init__(self, model: nn.Module, *, adapters_off: bool, device: torch.device):
        self.model, self.adapters_off, self.device = model, adapters_off, device

    @torch.no_grad()
    def logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[sequences] fp32 on the device, for a host batch (data.preference.PairPacked)."""
        context = adapters_disabled(self.model) if self.adapters_off else contextlib.nullcontext()
        was_training = self.model.training
        self.model.eval()
        try:
            with context:
                return packed_sequence_logprobs(self.model,
                                                model_inputs(self.model, batch, self.device))
        finally:
            self.model.train(was_training)

    def attach(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**batch, "ref_logps": self.logps(batch)}


def reshard(model: nn.Module) -> None:
    """Every FSDP unit of ``model`` back to its shards. A no_grad forward leaves the units FSDP
    does not reshard after forward (the last layer, [norm, head]) gathered until a backward
    that never comes, and their parameters are then the gathered tensors: an optimizer built
    at that moment would hold those, not the shards it must update."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _mesh(model: nn.Module) -> Any:
    from torch.distributed.tensor import DTensor

    return next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)


def frozen_copy(spec: RunSpec, policy: nn.Module, device: torch.device) -> nn.Module:
    """The initial weights again, frozen, in the compute dtype, sharded per decoder layer like
    the policy on its mesh (plain, a whole replica, under sharding=no_shard), each unit
    resharded after its forward: at most a layer or two gathered at once."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from .. import checkpoint as ckpt_io
    from ..model.llama import (
        build_meta_model,
        decoder_layers,
        init_buffers,
        init_weights,
        retie_embeddings,
    )
    from ..model.parallelize import apply_compile, mixed_precision, torch_dtype

    model = build_meta_model(spec.model).to(torch_dtype(spec.policy.frozen_dtype))
    model.requires_grad_(False)
    if spec.train.loss == TrainConfig.CHUNKED:  # its log-probs take the policy's path (loss.py)
        install_loss_head(model, chunk=spec.train.loss_chunk)
    layers = decoder_layers(model)
    if spec.train.compile:
        apply_compile(layers)
    mesh = _mesh(policy)
    if mesh is not None:
        common: dict[str, Any] = {"mesh": mesh, "mp_policy": mixed_precision(spec.policy),
                                  "reshard_after_forward": True}
        if spec.sharding.cpu_offload:
            common["offload_policy"] = CPUOffloadPolicy()
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        tied = head.weight is embed.weight
        if not tied:
            fully_shard(embed, **common)
        for layer in layers:
            fully_shard(layer, **common)
        if not tied:
            fully_shard([model.model.norm, head], **common)
        fully_shard(model, **common)
    model.to_empty(device=torch.device("cpu") if spec.sharding.cpu_offload else device)
    if mesh is None:
        retie_embeddings(model)
    if spec.model.path:
        init_buffers(model)  # RoPE's frequencies: computed, not in the files
        ckpt_io.load_hf_weights(model, spec.model.path)
    else:
        init_weights(model, std=spec.model.init_std, seed=spec.train.seed)
    return model.eval()


# --- cached ----------------------------------------------------------------------------------


def _weights_stamp(spec: RunSpec) -> dict[str, Any]:
    """What the reference's weights are: model.path's files (name, size, mtime), or the seeded
    init of the group's shape; with the compute dtype and a QLoRA base's quantization."""
    m, ft = spec.model, spec.finetune
    if m.path:
        files = sorted(p for p in Path(m.path).iterdir()
                       if p.suffix == ".safetensors" or p.name == "config.json")
        source: Any = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    else:
        source = {"init_std": m.init_std, "seed": spec.train.seed,
                  "shape": [m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads,
                            m.intermediate_size, m.vocab_size, m.tie_word_embeddings,
                            m.rope_theta, m.rms_norm_eps]}
    nf4 = ([sorted(ft.target_modules), ft.nf4_block_size, ft.nf4_scaler_block_size]
           if ft.nf4 else None)
    return {"weights": source, "compute_dtype": spec.policy.compute_dtype, "nf4": nf4}


def cache_path(spec: RunSpec, data_cache: str) -> Path:
    """cache_dir/reference/<tokenized data entry>-<key>: keyed by the tokenized data (its entry
    name holds its key: source, tokenizer, seq_len), the weights and the compute dtype."""
    blob = json.dumps({"data": Path(data_cache).name, **_weights_stamp(spec)}, sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return Path(spec.cache_dir) / REFERENCE_DIR / f"{Path(data_cache).name}-{key}"


def _split_logps(packed: Any, logps: Callable[[dict], torch.Tensor], *, micro_batch: int,
                 rank: int, world: int, device: torch.device, progress: Callable[[int], None]
                 ) -> np.ndarray:
    """Every record's reference log-prob (fp32): each rank a block of rows, the same number of
    forward calls on every rank (padding rows carry nothing), summed across ranks."""
    per_rank = -(-len(packed) // world // micro_batch) * micro_batch
    rows = np.arange(rank * per_rank, (rank + 1) * per_rank)
    rows[rows >= len(packed)] = -1
    out = torch.zeros(len(packed.store), dtype=torch.float32, device=device)
    for i in range(0, per_rank, micro_batch):
        batch = packed.batch(rows[i:i + micro_batch])
        out[batch["seq_records"].to(device)] = logps(batch).float()
        progress(micro_batch)
    if world > 1:
        dist.all_reduce(out)  # each record was filled by one rank, zero elsewhere
    return out.cpu().numpy()


def cached_logps(spec: RunSpec, data: Any, logps: Callable[[], Callable[[dict], torch.Tensor]],
                 *, rank: int, world: int, device: torch.device) -> Path:
    """Set ``data``'s splits' ``ref_logps`` from the cache, computing them first if it has none
    (every rank, collectively; rank 0 writes the entry atomically). ``logps``: makes the function
    that computes a batch's reference log-probs, called only when the cache has none."""
    path = cache_path(spec, data.info.cache_path)
    ready = torch.tensor([float(cached_entry_ok(path, digests=False))])
    if world > 1:
        dist.all_reduce(ready, op=dist.ReduceOp.MIN)
    if not bool(ready.item()):
        values = _compute(spec, data, logps(), rank=rank, world=world, device=device)
        if rank == 0:
            _write(path, values, spec)
        if world > 1:
            dist.barrier()
    for split in SPLITS:
        getattr(data, split).ref_logps = np.load(path / f"{split}.npy")
    return path


def _compute(spec: RunSpec, data: Any, logps: Callable[[dict], torch.Tensor], *, rank: int,
             world: int, device: torch.device) -> dict[str, np.ndarray]:
    total = sum(len(getattr(data, s)) for s in SPLITS)
    t0, done, shown = time.perf_counter(), [0], [0.0]

    def progress(rows: int) -> None:
        done[0] += rows * world
        if rank == 0 and (done[0] / total >= shown[0] + 0.1 or done[0] >= total):
            shown[0] = done[0] / total
            log.info("reference log-probs: %d%% of %d rows", min(100, 100 * done[0] // total),
                     total)

    if rank == 0:
        log.info("reference log-probs: computing them once for %d train and %d eval pairs "
                 "(objective.reference=cached)", data.train.pairs, data.eval.pairs)
    out = {s: _split_logps(getattr(data, s), logps, micro_batch=spec.train.batch_size,
                           rank=rank, world=world, device=device, progress=progress)
           for s in SPLITS}
    if rank == 0:
        log.info("reference log-probs computed in %.1fs", time.perf_counter() - t0)
    return out


def _write(path: Path, values: dict[str, np.ndarray], spec: RunSpec) -> None:
    """The entry, published whole: a temporary directory, its manifest, a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        for split, v in values.items():
            np.save(tmp / f"{split}.npy", v.astype(np.float32))
        (tmp / "meta.json").write_text(json.dumps(
            {**_weights_stamp(spec), "sequences": {s: len(v) for s, v in values.items()}},
            indent=1))
        write_manifest(tmp, digests=True)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("reference log-probs cached in %s (%d bytes)", path,
             sum(f.stat().st_size for f in path.iterdir()))

