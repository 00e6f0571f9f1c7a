"""torchtitan's own Trainer on the same Llama 3 shape, batch and sequence length.

    torchrun --standalone --nproc-per-node N -m benchmarks.peers.titan --shape shape.json \
        --batch-size 8 --seq-len 128 --steps 30 --info info.json

The shape is registered as a custom flavor of torchtitan's ``llama3`` model (its own model
code, its FSDP2 ``parallelize_llama``, its loop). Only what a benchmark must control is
swapped, through torchtitan's own extension points: random fixed-seed token rows instead of a
dataset (so no tokenizer either), plain cross-entropy (sum / global valid tokens), AdamW
foreach, no activation checkpointing, and a step-end stamp from a ``Trainer.train_step``
override.

Two torchtitan generations, as installed (benchmarks/setup_peers.sh picks by torch version):
- 0.3.x (torch >= 2.12: it imports ``DataParallelMeshDims``): ``Trainer.Config`` components;
  its language models offer only flex or varlen attention (no SDPA), so the attention kernel
  differs from the transformers runners; it has no CPU path (flex has no CPU backward).
- 0.2.x (torch 2.11 images): ``JobConfig`` plus a registered ``TrainSpec``; it has SDPA, the
  transformers runners' kernel. Its llama3 has no weight tying, so a tied shape (1B, 3B)
  trains a separate output matrix (vocab x hidden more parameters, the same FLOPs). torchtitan
  picks ``cuda`` when no accelerator is present; on ``--device cpu`` this runner points that
  choice at the CPU (gloo, and a memory monitor that reports nothing), torchtitan's loop
  unchanged otherwise.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.peers.common import (
    load_shape,
    parse_args,
    random_tokens,
    threads_per_rank,
    write_info,
)
from benchmarks.step_clock import StepClock

FLAVOR = "benchmark"
ATTENTION = "flex"          # 0.3.x
ATTENTION_V02 = "sdpa"      # 0.2.x
SPEC_V02 = "llama3_benchmark"


def generation() -> str:
    """``"0.3"`` for torchtitan's ``Trainer.Config`` API (torchtitan.trainer), else ``"0.2"``."""
    import importlib.util
    from pathlib import Path

    # read from the files, not by importing: torchtitan's import probes the device, and on CPU
    # point_titan_at_cpu must come before that
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("torchtitan is not installed here: run benchmarks/setup_peers.sh")
    root = Path(next(iter(spec.submodule_search_locations)))
    return "0.3" if (root / "trainer.py").exists() or (root / "trainer").is_dir() else "0.2"


def register_flavor(shape: dict[str, Any]) -> Any:
    """Add ``shape`` to torchtitan's llama3 flavors; return its ModelSpec.

    Built with the same helpers torchtitan's own flavors (debugmodel, 1B, 8B, ...) use, with
    the FFN width taken as is (``intermediate_size``) instead of derived from a multiplier.
    """
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    dim, heads, vocab = shape["hidden_size"], shape["num_heads"], shape["vocab_size"]
    rs = shape.get("rope_scaling")
    rope = ComplexRoPE.Config(
        dim=dim // heads, max_seq_len=shape["max_position_embeddings"],
        theta=shape["rope_theta"], scaling="llama" if rs else "none",
        **({"scaling_factor": rs["factor"], "low_freq_factor": rs["low_freq_factor"],
            "high_freq_factor": rs["high_freq_factor"],
            "original_max_position_embeddings": rs["original_max_position_embeddings"]}
           if rs else {}))

    def flavor(attn_backend: str, tp_gemm_backend: str = "default") -> Any:
        norm = {"normalized_shape": dim, "eps": shape["rms_norm_eps"],
                "param_init": llama3._NORM_INIT}
        return llama3.Llama3Model.Config(
            dim=dim, vocab_size=vocab, enable_weight_tying=shape["tie_word_embeddings"],
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                            param_init=llama3._EMBEDDING_INIT),
            norm=RMSNorm.Config(**norm),
            lm_head=Linear.Config(in_features=dim, out_features=vocab,
                                  param_init=llama3._output_linear_init(dim)),
            layers=llama3._build_llama3_layers(
                n_layers=shape["num_layers"], dim=dim, n_heads=heads,
                n_kv_heads=shape["num_kv_heads"], hidden_dim=shape["intermediate_size"],
                rope=rope, attn_backend=attn_backend, tp_gemm_backend=tp_gemm_backend))

    llama3.llama3_configs[FLAVOR] = flavor
    return llama3.model_registry(FLAVOR, attn_backend=ATTENTION)


def random_batches(*, vocab: int, seed: int, dp_rank: int, batch: int, seq_len: int,
                   positions: bool) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """torchtitan's (inputs, targets) pairs, forever: four fixed-seed random batches per
    data-parallel rank, cycled, one document per row (0.3 also takes the positions)."""
    rows = random_tokens(4, batch=batch, seq_len=seq_len, vocab=vocab, seed=seed + dp_rank,
                         device=torch.device("cpu"))
    extra = {"positions": torch.arange(seq_len).expand(batch, seq_len)} if positions else {}
    for r in itertools.cycle(rows):
        yield {"input": r[:, :-1], **extra}, r[:, 1:]


def components(vocab: int, seed: int) -> tuple[type, type]:
    """A tokenizer-free random-token data loader, as torchtitan Configurables."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class NoTokenizer(BaseTokenizer):
        """Random token ids need no tokenizer; torchtitan still builds one."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config: Config, *, tokenizer_path: str = ""):
            super().__init__()

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError

        def get_vocab_size(self) -> int:
            return vocab

    class RandomTokens(BaseDataLoader):
        """Fixed-seed random rows per data-parallel rank, one document per row."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config: Config, *, dp_rank: int, local_batch_size: int, seq_len: int,
                     **_: Any):
            self.shape = {"dp_rank": dp_rank, "batch": local_batch_size, "seq_len": seq_len}

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            return random_batches(vocab=vocab, seed=seed, positions=True, **self.shape)

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    return NoTokenizer, RandomTokens


def trainer_config(args: Any, shape: dict[str, Any]) -> Any:
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.trainer import Trainer

    tokenizer, loader = components(shape["vocab_size"], args.seed)
    optimizer = default_adamw(lr=args.lr, weight_decay=0.0)
    optimizer.implementation = "foreach"
    return Trainer.Config(
        model_spec=register_flavor(shape), hf_assets_path=str(args.info.parent),
        dump_folder=str(args.info.parent / "titan"), tokenizer=tokenizer.Config(),
        dataloader=loader.Config(), optimizer=optimizer,
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=min(6, args.steps - 1)),
        training=TrainingConfig(
            local_batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps,
            dtype="bfloat16" if args.precision == "bf16" else "float32",
            mixed_precision_param="float32" if args.precision == "fp32" else "bfloat16"),
        parallelism=ParallelismConfig(), activation_checkpoint=None,
        loss=CrossEntropyLoss.Config(global_vocab_size=shape["vocab_size"]))


class _CpuDevice:
    """The ``torch.cuda``-like calls torchtitan 0.2 makes on its device module, for the CPU:
    no device to set, no allocator statistics (its memory lines read -1 / 0%)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def set_device(device: Any) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return type("Props", (), {"total_memory": total})()

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def point_titan_at_cpu() -> None:
    """Before torchtitan is imported: its device probe (``_get_available_device_type() or
    "cuda"``) answers ``cpu``, with :class:`_CpuDevice` as the device module; its process group
    then takes gloo (torch's default backend for the cpu device type)."""
    import torch._utils as tu

    device_module = tu._get_device_module
    tu._get_available_device_type = lambda: "cpu"
    tu._get_device_module = lambda kind=None: (_CpuDevice() if kind in (None, "cpu")
                                               else device_module(kind))


def model_args_v02(shape: dict[str, Any], seq_len: int) -> Any:
    """The shape as torchtitan 0.2's ``TransformerModelArgs``. Its FFN width is derived
    (``int(8 * dim / 3)`` rounded up to ``multiple_of``), so ``multiple_of`` is the shape's own
    width, which any Llama 3 shape's width reaches from at or above."""
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    dim, width = shape["hidden_size"], shape["intermediate_size"]
    if int(8 * dim / 3) > width:
        raise SystemExit(f"torchtitan 0.2 cannot express FFN width {width} for hidden {dim} "
                         f"(its smallest is int(8 * {dim} / 3) = {int(8 * dim / 3)})")
    rs = shape.get("rope_scaling")
    # its RoPE always applies Llama 3.1 scaling; a factor of 1 leaves every frequency as is
    rope = (RoPEScalingArgs(scaling_factor=rs["factor"], low_freq_factor=rs["low_freq_factor"],
                            high_freq_factor=rs["high_freq_factor"],
                            original_max_position_embeddings=rs[
                                "original_max_position_embeddings"])
            if rs else RoPEScalingArgs(scaling_factor=1.0))
    return TransformerModelArgs(
        dim=dim, n_layers=shape["num_layers"], n_heads=shape["num_heads"],
        n_kv_heads=shape["num_kv_heads"], vocab_size=shape["vocab_size"], multiple_of=width,
        ffn_dim_multiplier=None, norm_eps=shape["rms_norm_eps"],
        rope_theta=float(shape["rope_theta"]), rope_scaling_args=rope, max_seq_len=seq_len,
        attn_type=ATTENTION_V02, attn_mask_type="causal")


def job_config_v02(args: Any, shape: dict[str, Any]) -> Any:
    """torchtitan 0.2's JobConfig for this run, its llama3 TrainSpec registered with the
    benchmark flavor and the random-token loader (no tokenizer, no validator)."""
    import dataclasses

    from torchtitan.config import JobConfig
    from torchtitan.models.llama3 import get_train_spec
    from torchtitan.protocols.train_spec import register_train_spec

    loader = loader_v02(shape["vocab_size"], args.seed)

    def build_loader(dp_world_size: int, dp_rank: int, tokenizer: Any, job_config: Any,
                     **_: Any) -> Any:
        return loader(dp_rank=dp_rank, local_batch_size=job_config.training.local_batch_size,
                      seq_len=job_config.training.seq_len)

    spec = get_train_spec()
    parallelize = spec.parallelize_fn

    def parallelize_on_gloo(model: Any, *a: Any, **kw: Any) -> Any:
        """torchtitan sums gradients (divide factor 1, it divides by the global token count
        itself), which FSDP2 sends as PREMUL_SUM(1.0): NCCL has it, gloo does not. A plain
        SUM with no division is the same reduction."""
        from torch.distributed.fsdp import FSDPModule

        model = parallelize(model, *a, **kw)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    register_train_spec(SPEC_V02, dataclasses.replace(
        spec, model_args={FLAVOR: model_args_v02(shape, args.seq_len)},
        parallelize_fn=parallelize_on_gloo if args.device == "cpu" else parallelize,
        build_tokenizer_fn=None, build_dataloader_fn=build_loader, build_validator_fn=None))
    jc = JobConfig()
    jc.job.dump_folder = str(args.info.parent / "titan")
    jc.model.name, jc.model.flavor = SPEC_V02, FLAVOR
    jc.model.hf_assets_path = str(args.info.parent)
    jc.optimizer.lr, jc.optimizer.weight_decay = args.lr, 0.0
    jc.optimizer.implementation = "foreach"
    jc.lr_scheduler.warmup_steps = min(6, args.steps - 1)
    jc.training.local_batch_size, jc.training.seq_len = args.batch_size, args.seq_len
    jc.training.steps = args.steps
    jc.training.dtype = "bfloat16" if args.precision == "bf16" else "float32"
    jc.training.mixed_precision_param = "float32" if args.precision == "fp32" else "bfloat16"
    jc.activation_checkpoint.mode = "none"
    return jc


def loader_v02(vocab: int, seed: int) -> type:
    """The random-token loader for torchtitan 0.2 (a Stateful iterable; no Config class)."""
    from torchtitan.components.dataloader import BaseDataLoader

    class RandomTokens(BaseDataLoader):
        def __init__(self, *, dp_rank: int, local_batch_size: int, seq_len: int) -> None:
            self.shape = {"dp_rank": dp_rank, "batch": local_batch_size, "seq_len": seq_len}

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            return random_batches(vocab=vocab, seed=seed, positions=False, **self.shape)

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    return RandomTokens


def what_ran(model_parts: list[Any]) -> str:
    """The data parallelism torchtitan really applied, read from the model: it shards only
    when its data-parallel shard degree is above 1 (on one GPU it trains the bare model)."""
    from torch.distributed.fsdp import FSDPModule

    units = sum(isinstance(m, FSDPModule) for part in model_parts for m in part.modules())
    return f"FSDP2 (fully_shard, {units} units)" if units else "no FSDP (one data-parallel rank)"


def main() -> None:
    args = parse_args(__doc__)
    torch.set_num_threads(threads_per_rank())
    gen = generation()
    if gen == "0.2" and args.device == "cpu":
        point_titan_at_cpu()
    from torchtitan.tools.logging import init_logger

    if gen == "0.3":
        from torchtitan.trainer import Trainer
    else:
        from torchtitan.train import Trainer

    class ClockedTrainer(Trainer):
        """torchtitan's Trainer with a step-end stamp on rank 0."""

        def train_step(self, data_iterator: Any) -> None:
            super().train_step(data_iterator)
            self.clock.stamp(self.step)

    init_logger()
    shape = load_shape(args.shape)
    config = trainer_config(args, shape) if gen == "0.3" else job_config_v02(args, shape)
    trainer = ClockedTrainer(config)
    rank = torch.distributed.get_rank()
    trainer.clock = StepClock(rank=rank, world_size=torch.distributed.get_world_size())
    import torchtitan

    attention = ATTENTION if gen == "0.3" else ATTENTION_V02
    tied = " (untied: 0.2 has no weight tying)" if (
        gen == "0.2" and shape["tie_word_embeddings"]) else ""
    params = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
    write_info(args.info, rank, {
        "ran": f"torchtitan {getattr(torchtitan, '__version__', gen)} llama3 flavor "
               f"'{FLAVOR}', {what_ran(trainer.model_parts)} via parallelize_llama, "
               f"{attention} attention{tied}",
        "precision": args.precision, "parameters": params,
        "threads_per_rank": threads_per_rank()})
    try:
        trainer.train()
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
