"""torchtitan's own Trainer on the same Llama 3 shape, batch and sequence length.

    torchrun --standalone --nproc-per-node N -m benchmarks.peers.titan --shape shape.json \
        --batch-size 8 --seq-len 128 --steps 30 --info info.json

The shape is registered as a custom flavor of torchtitan's ``llama3`` model (its own model
code, its FSDP2 ``parallelize_llama``, its loop). Only what a benchmark must control is
swapped, through torchtitan's own component configs: random fixed-seed token rows instead of a
dataset (so no tokenizer either), plain cross-entropy (sum / global valid tokens), AdamW
foreach, no activation checkpointing, and a step-end stamp from a ``Trainer.train_step``
override. torchtitan 0.3.0 language models only offer flex or varlen attention (no SDPA), so
the attention kernel differs from the transformers runners; the report says so.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.peers.common import load_shape, parse_args, threads_per_rank, write_info
from benchmarks.step_clock import StepClock

FLAVOR = "benchmark"
ATTENTION = "flex"


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
            gen = torch.Generator().manual_seed(seed + dp_rank)
            self.rows = [torch.randint(vocab, (local_batch_size, seq_len + 1), generator=gen)
                         for _ in range(4)]
            self.positions = torch.arange(seq_len).expand(local_batch_size, seq_len)

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            i = 0
            while True:
                rows = self.rows[i % len(self.rows)]
                i += 1
                yield {"input": rows[:, :-1], "positions": self.positions}, rows[:, 1:]

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


def main() -> None:
    args = parse_args(__doc__)
    torch.set_num_threads(threads_per_rank())
    from torchtitan.tools.logging import init_logger
    from torchtitan.trainer import Trainer

    class ClockedTrainer(Trainer):
        """torchtitan's Trainer with a step-end stamp on rank 0."""

        def train_step(self, data_iterator: Any) -> None:
            super().train_step(data_iterator)
            self.clock.stamp(self.step)

    init_logger()
    trainer = ClockedTrainer(trainer_config(args, load_shape(args.shape)))
    rank = torch.distributed.get_rank()
    trainer.clock = StepClock(rank=rank, world_size=torch.distributed.get_world_size())
    write_info(args.info, rank, {
        "ran": f"torchtitan llama3 flavor '{FLAVOR}', FSDP2 via parallelize_llama, "
               f"{ATTENTION} attention", "precision": args.precision,
        "threads_per_rank": threads_per_rank()})
    try:
        trainer.train()
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
