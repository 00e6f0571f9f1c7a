"""The chunked loss on real gloo ranks: a run's loss curve (and eval loss) equals the full
loss's under FSDP2 (tied and untied, with accumulation), DDP, LoRA and low precision; the
head's FSDP unit is all-gathered once per micro-batch; a micro-batch without a target token on
one rank does not hang the others; DTensor and plain inputs mix."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import make_spec
from tests.distributed import assert_rows_match, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

BASE = ["tracking.enabled=false", "cluster.nproc_per_node=2", "train.batch_size=4",
        "train.max_steps=4", "train.warmup_steps=1", "eval.every_steps=2", "eval.task_prompts=0",
        "train.loss_chunk=96"]  # 512 tokens a micro-batch: several chunks
PAIRS = {  # name: overrides; each runs with train.loss=full and =chunked
    "fsdp fp32 accum": ["precision=fp32", "train.grad_accum=2"],
    "tied fp32": ["precision=fp32", "model.tie_word_embeddings=true"],
    "no_shard mixed": ["sharding=no_shard", "precision=mixed"],
    "lora fp32": ["precision=fp32", "finetune=lora"],
    "bf16": ["precision=bf16"],
}


def _spec(name: str, loss: str, *extra: str):
    return make_spec([*BASE, *PAIRS.get(name, []), f"train.loss={loss}", *extra],
                     output_dir=f"/tmp/llama_fsdp_test/loss_{loss}_{name.replace(' ', '_')}")


def _curves(rank, world, specs):
    from llama_fsdp.train.worker import DistEnv, train_on_rank

    out = {}
    for name, spec in specs.items():
        r = train_on_rank(spec, DistEnv(rank, rank, world, world), torch.device("cpu"))
        out[name] = {"losses": r.losses, "eval_loss": r.final["eval_loss"]}
    return out


@pytest.fixture(scope="module")
def curves():
    specs = {(name, loss): _spec(name, loss) for name in PAIRS for loss in ("full", "chunked")}
    return run_ranks(_curves, 2, specs, timeout=600)[0]


@pytest.mark.parametrize("name", list(PAIRS))
def test_chunked_loss_curve_equals_the_full_loss_curve(curves, name):
    full, chunked = curves[(name, "full")], curves[(name, "chunked")]
    tol = 2e-2 if "bf16" in name or "mixed" in name else 2e-5  # bf16 logits: their rounding
    torch.testing.assert_close(chunked["losses"], full["losses"], rtol=tol, atol=tol)
    torch.testing.assert_close(chunked["eval_loss"], full["eval_loss"], rtol=tol, atol=tol)
    assert full["losses"][-1] < full["losses"][0]


# --- FSDP2's head unit ---------------------------------------------------------------------------


def _count_collectives(rank, world, specs):
    """All-gathers and reduce-scatters of FSDP2's unit that holds the output head, per step."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_mod

    from llama_fsdp.data import build_data
    from llama_fsdp.train.optimizer import build_optimizer
    from llama_fsdp.train.loop import build_scheduler, train_step
    from llama_fsdp.train.worker import build_model

    out = {}
    for name, spec in specs.items():
        model = build_model(spec, torch.device("cpu"))
        head = model.get_output_embeddings()
        counts = {"all_gather": 0, "reduce_scatter": 0}

        def counting(fn, key):
            def wrapped(fsdp_params, *args, **kwargs):
                if any(p._module_info.module is head or head in p._module_info.shared_modules
                       for p in fsdp_params):  # (tied: the embedding's weight, shared)
                    counts[key] += 1
                return fn(fsdp_params, *args, **kwargs)
            return wrapped

        saved = group_mod.foreach_all_gather, group_mod.foreach_reduce
        group_mod.foreach_all_gather = counting(saved[0], "all_gather")
        group_mod.foreach_reduce = counting(saved[1], "reduce_scatter")
        try:
            opt = build_optimizer(model, spec.train, spec.optim)
            data = build_data(spec.data, **spec.data_kwargs(dp_rank=rank, announce=False))
            batches = data.train_batches()
            micro = [next(batches) for _ in range(spec.train.grad_accum)]
            train_step(model, opt, build_scheduler(opt, spec.train), micro,
                       device=torch.device("cpu"), max_grad_norm=1.0)
        finally:
            group_mod.foreach_all_gather, group_mod.foreach_reduce = saved
        out[name] = counts
    return out


def test_the_head_unit_is_gathered_once_per_micro_batch():
    """[norm, head] (untied) and the root (tied) are all-gathered and reduce-scattered once per
    micro-batch however many chunks the loss has (here 6), and a frozen head (LoRA) is not
    reduce-scattered at all."""
    specs = {"untied": _spec("fsdp fp32 accum", "chunked"),
             "tied": _spec("tied fp32", "chunked"),
             "lora": _spec("lora fp32", "chunked", "train.grad_accum=2")}
    res = run_ranks(_count_collectives, 2, specs)[0]
    assert res["untied"] == {"all_gather": 2, "reduce_scatter": 2}  # 2 micro-batches
    assert res["tied"] == {"all_gather": 1, "reduce_scatter": 1}
    assert res["lora"] == {"all_gather": 2, "reduce_scatter": 0}


# --- a micro-batch without targets ---------------------------------------------------------------


def _masked_micro_batches(spec, gens, rank, steps=2):
    """Per step, the micro-batches of the data ranks in ``gens`` (data rank: its generator),
    in rank order: two each, the second of data rank 1 without a target token."""
    from llama_fsdp.data import IGNORE_INDEX

    out = []
    for _ in range(steps):
        micro = []
        for data_rank, gen in gens.items():
            for i in range(2):
                ids = torch.randint(0, spec.model.vocab_size, (2, 64), generator=gen)
                labels = ids.roll(-1, 1)
                if data_rank == 1 and i == 1:
                    labels[:] = IGNORE_INDEX
                micro.append({"input_ids": ids, "labels": labels})
        out.append(micro)
    return out


def _masked_step(rank, world, specs):
    """Two steps in which data rank 1's second micro-batch has no target token: on 2 ranks each
    rank steps its own micro-batches; on 1 rank the one rank steps both ranks' (4 a step). What
    this rank computed: the gradient norm at each step, and its part of every trainable
    parameter after the steps (its own reduce-scattered gradient, its own AdamW step)."""
    from llama_fsdp.train.optimizer import build_optimizer
    from llama_fsdp.train.loop import build_scheduler, train_step
    from llama_fsdp.train.worker import build_model
    from tests.distributed import trained_parts

    out = {}
    for name, spec in specs.items():
        model = build_model(spec, torch.device("cpu"))
        opt = build_optimizer(model, spec.train, spec.optim)
        sched = build_scheduler(opt, spec.train)
        data_ranks = [rank] if world > 1 else [0, 1]
        gens = {r: torch.Generator().manual_seed(r) for r in data_ranks}
        norms = []
        for micro in _masked_micro_batches(spec, gens, rank):
            res = train_step(model, opt, sched, micro, device=torch.device("cpu"),
                             max_grad_norm=1.0)
            norms.append(float(res.grad_norm))
        out[name] = {"grad_norms": norms, "parts": trained_parts(model)}
    return out


MASKED = ("fsdp fp32 accum", "tied fp32", "no_shard mixed", "lora fp32")
# A weight after two AdamW steps, 2 ranks against 1: the same sums in another order, which the
# step's division by the gradient's root mean square magnifies where that is near zero: up to
# 1.9e-5 (no_shard mixed: bit-identical). A step normalized by this rank's target tokens instead
# of all ranks' is off by about lr (3e-3).
MASKED_ATOL = 1e-4


def test_a_micro_batch_without_targets_on_one_rank_does_not_hang():
    """Nor skews the step: each rank's part of the weights after two steps, and its gradient
    norms, are those of one rank stepping both ranks' micro-batches (the loss divided by the
    target tokens of all ranks, not of this rank's micro-batches: rank 1 has fewer)."""
    extra = ("train.grad_accum=2", "train.batch_size=2")
    specs = {name: _spec(name, "chunked", *extra) for name in MASKED}
    one = {name: _spec(name, "chunked", *extra, "cluster.nproc_per_node=1") for name in MASKED}
    res = run_ranks(_masked_step, 2, specs, timeout=180)
    whole = run_ranks(_masked_step, 1, one, timeout=180)[0]
    for name in MASKED:
        want = whole[name]["grad_norms"]
        assert all(n > 0 and n == n for n in want), (name, want)
        for rank, r in enumerate(res):
            torch.testing.assert_close(r[name]["grad_norms"], want, rtol=1e-5, atol=0,
                                       msg=lambda m: f"{name}, rank {rank}: grad norms: {m}")
            assert_rows_match(r[name]["parts"], whole[name]["parts"], rtol=1e-4,
                              atol=MASKED_ATOL, msg=f"{name}, rank {rank}")


# --- DTensor and plain tensors ---------------------------------------------------------------------


def _dtensor_inputs(rank, world):
    """Per mix of DTensor and plain inputs: the loss's and the weight gradient's largest
    difference from the plain computation (the same full tensors on every rank)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from llama_fsdp.objective.loss import chunked_cross_entropy

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(40, 16, generator=gen), torch.randn(50, 16, generator=gen)
    labels = torch.randint(0, 50, (40,), generator=gen)
    plain_w = weight.clone().requires_grad_()
    ref = F.cross_entropy(hidden @ plain_w.T, labels, reduction="sum")
    ref.backward()
    out = {}
    for name, (h_place, w_place) in {"sharded weight": (None, Shard(0)),
                                     "replicated hidden": (Replicate(), None)}.items():
        h = distribute_tensor(hidden, mesh, [h_place]) if h_place else hidden.clone()
        w = distribute_tensor(weight, mesh, [w_place]) if w_place else weight.clone()
        h.requires_grad_()
        w.requires_grad_()
        loss = chunked_cross_entropy(h, w, labels, chunk=16)
        loss.backward()
        w_grad = w.grad.full_tensor() if hasattr(w.grad, "full_tensor") else w.grad
        out[name] = (float((loss.detach() - ref.detach()).abs()),
                     float((w_grad - plain_w.grad).abs().max()))
    return out


def test_dtensor_and_plain_inputs_give_the_plain_loss():
    for rank_res in run_ranks(_dtensor_inputs, 2):
        for name, (loss_err, grad_err) in rank_res.items():
            assert loss_err < 1e-4 and grad_err < 1e-5, (name, loss_err, grad_err)


# --- checkpointing.offload ----------------------------------------------------------------------


def _grads_with_and_without_offload(rank, world, specs):
    """Each spec's gradients after one micro-batch's backward (full tensors), without and with
    checkpointing.offload, and how many tensors the offload hooks moved (one input a
    checkpointed layer: torch 2.11's empty placeholder stays where it is)."""
    from llama_fsdp.model import offload
    from llama_fsdp.model.attention import model_inputs
    from llama_fsdp.objective.loss import loss_sum
    from llama_fsdp.train.worker import build_model

    packed = [0]
    original = offload.ActivationOffload.pack

    def counting(self, t):  # what was moved off the device
        moved = original(self, t)
        packed[0] += isinstance(moved, offload._Packed)
        return moved

    offload.ActivationOffload.pack = counting
    out = {}
    try:
        for name, spec in specs.items():
            model = build_model(spec, torch.device("cpu"))
            gen = torch.Generator().manual_seed(rank)
            ids = torch.randint(0, spec.model.vocab_size, (2, 64), generator=gen)
            batch = model_inputs(model, {"input_ids": ids, "labels": ids.roll(-1, 1)},
                                 torch.device("cpu"))
            before = packed[0]
            torch.manual_seed(0)  # the same LoRA dropout masks with and without offload
            loss_sum(model, batch).backward()
            out[name] = {"packed": packed[0] - before, "grads": {
                n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).tolist()
                for n, p in model.named_parameters() if p.grad is not None}}
    finally:
        offload.ActivationOffload.pack = original
    return out


def test_offloaded_activations_give_bit_identical_gradients():
    configs = {"fsdp fp32 AC full": ["precision=fp32", "checkpointing=full"],
               "no_shard bf16 AC selective": ["sharding=no_shard", "precision=bf16",
                                              "checkpointing=selective"],
               "lora dropout AC full": ["finetune=lora", "finetune.dropout=0.1",
                                        "checkpointing=full"]}
    specs = {(name, off): make_spec([*BASE, *extra, f"checkpointing.offload={off}"],
                                    output_dir="/tmp/llama_fsdp_test/offload")
             for name, extra in configs.items() for off in ("false", "true")}
    res = run_ranks(_grads_with_and_without_offload, 2, specs)[0]
    for name in configs:
        kept, off = res[(name, "false")], res[(name, "true")]
        wrapped = len(specs[(name, "true")].checkpointing.wrapped_layers(4))
        assert kept["packed"] == 0 and off["packed"] == wrapped, (name, off["packed"])
        assert kept["grads"].keys() == off["grads"].keys() and kept["grads"]
        for param, grad in kept["grads"].items():
            assert off["grads"][param] == grad, (name, param)  # bit for bit
