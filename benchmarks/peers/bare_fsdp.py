"""The floor: a bare FSDP2 loop over transformers' LlamaForCausalLM, nothing else.

    torchrun --standalone --nproc-per-node N -m benchmarks.peers.bare_fsdp --shape shape.json \
        --batch-size 8 --seq-len 128 --steps 30 --info info.json

``fully_shard`` per decoder layer, then the root; AdamW(foreach=True); the loss is the summed
cross-entropy over the global number of target tokens (every token of a random batch is a
target, so that count is B x T x world and needs no collective). No clipping, no schedule, no
logging: whatever llama_fsdp spends beyond this loop is framework overhead.

``--packed`` (a diagnostic) also passes position_ids that restart at fixed-seed random record
lengths, as packed rows have: transformers then builds a block-causal mask for SDPA instead
of taking the plain causal path. The difference to the plain run is the price of that mask.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaForCausalLM

from benchmarks.peers.common import (
    init_distributed,
    llama_config,
    load_shape,
    packed_positions,
    parse_args,
    random_tokens,
    threads_per_rank,
    write_info,
)
from benchmarks.step_clock import StepClock

# (sharded parameter dtype, FSDP2 mixed-precision policy), as llama_fsdp's precision groups.
POLICIES = {
    "fp32": (torch.float32, MixedPrecisionPolicy()),
    "mixed": (torch.float32, MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                  reduce_dtype=torch.float32)),
    "bf16": (torch.bfloat16, MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                  reduce_dtype=torch.bfloat16)),
}
DISTINCT_BATCHES = 4  # cycled, so the loop never waits on data
# --packed: record lengths drawn uniformly from this range, like llama_fsdp's synthetic records
# (median 8 tokens, p95 12: 12-21 records in a 128-token row)
RECORD_LENGTHS = (4, 12)


def build_model(shape: dict, precision: str, device: torch.device, seed: int) -> LlamaForCausalLM:
    """The same replica on every rank (same seed), then sharded: layers first, the root last."""
    param_dtype, policy = POLICIES[precision]
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(shape)).to(param_dtype)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def main() -> None:
    args = parse_args(__doc__, {"--packed": {"action": "store_true"}})
    d = init_distributed(args.device)
    shape = load_shape(args.shape)
    model = build_model(shape, args.precision, d.device, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0,
                            foreach=True)
    batches = random_tokens(DISTINCT_BATCHES, batch=args.batch_size, seq_len=args.seq_len,
                            vocab=shape["vocab_size"], seed=args.seed + d.rank, device=d.device)
    targets = args.batch_size * args.seq_len * d.world
    extra = ({"position_ids": packed_positions(
        args.batch_size, args.seq_len, RECORD_LENGTHS,
        torch.Generator().manual_seed(args.seed + d.rank)).to(d.device)} if args.packed else {})
    write_info(args.info, d.rank, {
        "ran": f"FSDP2 fully_shard x {len(model.model.layers)} layers + root",
        "parameters": sum(p.numel() for p in model.parameters()),
        "precision": args.precision, "packed_position_ids": args.packed,
        "threads_per_rank": threads_per_rank(),
        "world_size": d.world})
    clock = StepClock(rank=d.rank, world_size=d.world)
    model.train()
    for step in range(1, args.steps + 1):
        tokens = batches[step % DISTINCT_BATCHES]
        logits = model(input_ids=tokens[:, :-1], **extra).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(),
                               reduction="sum") / targets
        (loss * d.world).backward()  # FSDP averages gradients over ranks: undo it
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.stamp(step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
