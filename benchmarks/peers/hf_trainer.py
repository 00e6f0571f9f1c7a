"""Hugging Face Trainer on the same Llama, batch and sequence length: FSDP2 or DDP.

    torchrun --standalone --nproc-per-node N -m benchmarks.peers.hf_trainer --shape shape.json \
        --batch-size 8 --seq-len 128 --steps 30 --info info.json [--sharding full|no_shard]

``--lora-rank R`` trains PEFT LoRA adapters of rank R (alpha ``--lora-alpha``, no dropout) on
the seven attention and MLP projections llama_fsdp's finetune=lora adapts, the base frozen:
Trainer + PEFT, as a user would fine-tune with adapters.

``--sharding full`` asks for FSDP2 full sharding with transformer-layer auto-wrap:
``fsdp=True, fsdp_config={"fsdp_version": 2, "reshard_after_forward": True, ...}``, the
non-deprecated spelling of ``fsdp="full_shard auto_wrap"``; ``no_shard`` asks for plain DDP.
What Trainer and accelerate actually ran (they may fall back to DDP, e.g. on CPU) is detected
from the wrapped model after training and written to ``--info``, so the report never guesses.
The optimizer is the same AdamW(foreach=True); the loss is Trainer's own: summed
cross-entropy over the global number of target tokens (``average_tokens_across_devices``).
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from benchmarks.peers.common import (
    init_distributed,
    llama_config,
    load_shape,
    parse_args,
    threads_per_rank,
    write_info,
)
from benchmarks.step_clock import StepClock

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FSDP_CONFIG = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
               "reshard_after_forward": True}


class RandomTokens(Dataset):
    """Fixed-seed random rows; the labels are the inputs (the model shifts them)."""

    def __init__(self, rows: int, seq_len: int, vocab: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(vocab, (rows, seq_len), generator=gen)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class ClockCallback(TrainerCallback):
    """Stamps every optimizer step's end (Trainer has incremented global_step by then)."""

    def __init__(self, clock: StepClock):
        self.clock = clock

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.clock.stamp(state.global_step)


def what_ran(trainer: Trainer) -> str:
    """The data-parallel wrapping Trainer really used, read from the trained model."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    units = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
    wrapped = trainer.model_wrapped
    if units:
        return f"FSDP2 (fully_shard, {units} units)"
    if type(wrapped).__name__ == "FullyShardedDataParallel":
        return "FSDP1 (FullyShardedDataParallel)"
    if isinstance(wrapped, DistributedDataParallel):
        return f"DDP (find_unused_parameters={wrapped.find_unused_parameters})"
    return f"no data-parallel wrapper ({type(wrapped).__name__})"


def training_args(args: Any, out_dir: str) -> TrainingArguments:
    shard = args.sharding == "full"
    return TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=args.batch_size, max_steps=args.steps,
        learning_rate=args.lr, adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0,
        save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        use_cpu=args.device == "cpu", bf16=args.precision != "fp32",
        fsdp=shard, fsdp_config=FSDP_CONFIG if shard else None,
        dataloader_num_workers=0, remove_unused_columns=False, seed=args.seed)


def main() -> None:
    args = parse_args(__doc__, {"--sharding": {"choices": ("full", "no_shard"), "default": "full"},
                                "--lora-rank": {"type": int, "default": 0},
                                "--lora-alpha": {"type": float, "default": None}})
    d = init_distributed(args.device)
    shape = load_shape(args.shape)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(llama_config(shape))
    if args.precision == "bf16":
        model = model.to(torch.bfloat16)
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=args.lora_rank, lora_alpha=args.lora_alpha or 2 * args.lora_rank, lora_dropout=0.0,
            target_modules=list(LORA_TARGETS), bias="none"))
    data = RandomTokens(args.steps * args.batch_size * d.world, args.seq_len,
                        shape["vocab_size"], args.seed)
    optim = (torch.optim.AdamW, {"lr": args.lr, "betas": (0.9, 0.95), "weight_decay": 0.0,
                                 "foreach": True})
    trainer = Trainer(model=model, args=training_args(args, str(args.info.parent / "hf")),
                      train_dataset=data, optimizer_cls_and_kwargs=optim,
                      callbacks=[ClockCallback(StepClock(rank=d.rank, world_size=d.world))])
    trainer.train()
    lora = f", PEFT LoRA r={args.lora_rank}" if args.lora_rank else ""
    write_info(args.info, d.rank, {
        "ran": f"{what_ran(trainer)}, accelerate {trainer.accelerator.distributed_type.value}"
               f"{lora}",
        "asked": args.sharding, "precision": args.precision,
        "bf16_autocast": args.precision != "fp32",
        "threads_per_rank": threads_per_rank(), "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "world_size": d.world})


if __name__ == "__main__":
    main()
