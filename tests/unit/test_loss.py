"""The chunked loss (llama_fsdp/objective/loss.py) against F.cross_entropy over the full logits: the loss,
the gradients of the hidden states and of the head, the per-token log-probs, in fp32, bf16 and
under autocast; the largest tensor it makes; and the same through a real Llama's head, tied or
not, frozen or not, in training and eval."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from llama_fsdp.objective import loss as L
from llama_fsdp.config.schema import ModelConfig
from llama_fsdp.data import IGNORE_INDEX

N, H, V = 300, 64, 1000


def _inputs(dtype: torch.dtype, *, masked_every: int = 7, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * 0.1).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[::masked_every] = IGNORE_INDEX
    return hidden, weight, labels


def _full(hidden, weight, labels):
    """What train.loss=full computes: logits in the inputs' dtype, the loss in fp32."""
    return F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=IGNORE_INDEX,
                           reduction="sum")


SCALE = torch.tensor(0.37)  # what train_step multiplies the loss by: world / targets


def _grads(fn, hidden, weight, labels):
    hidden.grad = weight.grad = None
    out = fn(hidden, weight, labels)
    (out * SCALE).backward()
    return out.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("chunk", [32, 64, 299, 4096])
def test_fp32_loss_and_gradients_equal_cross_entropy_over_the_full_logits(chunk):
    hidden, weight, labels = _inputs(torch.float32)
    ref = _grads(_full, hidden, weight, labels)
    got = _grads(lambda h, w, y: L.chunked_cross_entropy(h, w, y, chunk=chunk,
                                                         grad_scale=SCALE),
                 hidden, weight, labels)
    for name, a, b in zip(("loss", "grad hidden", "grad head"), got, ref):
        # to 1e-6 of the largest value (fp32 matmuls over other blocks sum in another order)
        err = (a - b).abs().max().item()
        assert err <= 1e-6 * b.abs().max().item(), (name, err)


def test_bf16_is_within_bf16_rounding_of_the_exact_loss():
    """Against the fp64 loss of the same bf16 inputs: the loss (fp32 math over bf16 logits) as
    close as the full loss's; the gradients of the full loss within one bf16 step of the
    largest value, the chunked loss's within two (the head's gradient is summed over 5 chunks
    in bf16, one rounding each, as FSDP2 sums a gradient over backward calls), within one with
    a single chunk."""
    hidden, weight, labels = _inputs(torch.bfloat16)
    exact = _grads(_full, hidden.double().detach().requires_grad_(),
                   weight.double().detach().requires_grad_(), labels)
    full = _grads(_full, hidden, weight, labels)
    for chunk, steps in ((64, 2), (N, 1)):
        chunked = _grads(lambda h, w, y: L.chunked_cross_entropy(h, w, y, chunk=chunk,
                                                                 grad_scale=SCALE),
                         hidden, weight, labels)
        # the loss, summed in fp32 from bf16 logits: as close as the full loss's
        full_err, err = ((x[0].double() - exact[0]).abs().item() for x in (full, chunked))
        assert err <= 2 * full_err + 1e-3, ("loss", err, full_err)
        for name, e, f, c in zip(("grad hidden", "grad head"), exact[1:], full[1:], chunked[1:]):
            step = e.abs().max().item() * 2**-8  # one bf16 step at the largest value
            assert (f.double() - e).abs().max().item() <= step, (name, "full")
            assert (c.double() - e).abs().max().item() <= steps * step, (name, chunk)


def test_autocast_runs_the_head_in_its_dtype():
    """DDP's precision=mixed: fp32 weights under autocast. The chunked loss runs the head in
    bf16 as F.linear would (far closer to autocast's result than fp32 math is), and gives fp32
    gradients to the fp32 tensors."""
    hidden, weight, labels = _inputs(torch.float32)

    def linear(h, w, y):
        return F.cross_entropy(F.linear(h, w).float(), y, ignore_index=IGNORE_INDEX,
                               reduction="sum")

    fp32 = _grads(linear, hidden, weight, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _grads(linear, hidden, weight, labels)
        got = _grads(lambda h, w, y: L.chunked_cross_entropy(h, w, y, chunk=64,
                                                             grad_scale=SCALE),
                     hidden, weight, labels)
    assert got[1].dtype == got[2].dtype == torch.float32
    for name, a, b, c in zip(("loss", "grad hidden"), got, ref, fp32):
        err, bf16_vs_fp32 = (a - b).abs().max().item(), (c - b).abs().max().item()
        assert err <= 0.1 * bf16_vs_fp32, (name, err, bf16_vs_fp32)
    # the head's gradient, summed over 5 chunks in bf16: within two bf16 steps
    assert (got[2] - ref[2]).abs().max() <= 2 * 2**-8 * ref[2].abs().max()


def test_token_logprobs_and_their_gradients_equal_log_softmax():
    hidden, weight, labels = _inputs(torch.float32)
    upstream = torch.randn(N, generator=torch.Generator().manual_seed(3))

    def full(h, w, y):
        lp = torch.log_softmax((h @ w.T).float(), -1).gather(1, y.clamp(min=0)[:, None])[:, 0]
        return (lp.where(y != IGNORE_INDEX, 0.0) * upstream).sum()

    def chunked(h, w, y):
        lp = L.chunked_token_logprobs(h, w, y, chunk=64)
        assert lp.shape == y.shape and (lp[y == IGNORE_INDEX] == 0).all()
        return (lp * upstream).sum()

    ref, got = _grads(full, hidden, weight, labels), _grads(chunked, hidden, weight, labels)
    for name, a, b in zip(("sum", "grad hidden", "grad head"), got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item(), msg=name)


def test_all_masked_gives_zero_loss_and_zero_gradients_not_none():
    """Every rank must reach the head's and the layers' backward (FSDP reduce-scatters them):
    a micro-batch without a target token still gives gradients, all zero."""
    hidden, weight, labels = _inputs(torch.float32)
    labels[:] = IGNORE_INDEX
    out = L.chunked_cross_entropy(hidden, weight, labels, chunk=64)
    out.backward()
    assert out.item() == 0.0 and out.requires_grad
    assert hidden.grad is not None and weight.grad is not None
    assert not hidden.grad.any() and not weight.grad.any()


class _Largest(TorchDispatchMode):
    """The largest tensor any op makes while active (elements)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_more_than_one_chunk_of_logits():
    """The largest tensor made in forward and backward: every logit on the full path, one
    chunk's on the chunked one (here above the head's gradient, vocab x hidden)."""
    hidden, weight, labels = _inputs(torch.float32)
    assert 100 * V > V * H
    for fn, bound in ((_full, N * V),
                      (lambda h, w, y: L.chunked_cross_entropy(h, w, y, chunk=100), 100 * V)):
        with _Largest() as seen:
            fn(hidden, weight, labels).backward()
        assert seen.largest == bound


# --- through a real model's head ---------------------------------------------------------------

TINY = dict(name="t", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            intermediate_size=128, vocab_size=300, max_position_embeddings=64)


def _model(tied: bool, chunked: bool, frozen_head: bool = False):
    from llama_fsdp.model.llama import build_meta_model, init_weights, retie_embeddings

    model = build_meta_model(ModelConfig(**TINY, tie_word_embeddings=tied))
    if chunked:
        L.install(model, chunk=24)
    model.to_empty(device="cpu")
    retie_embeddings(model)
    init_weights(model, std=0.02, seed=0)
    if frozen_head:
        model.get_output_embeddings().weight.requires_grad_(False)
    return model


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (3, 32), generator=gen)
    labels = ids.roll(-1, 1)
    labels[:, :8] = IGNORE_INDEX  # a prompt
    labels[2] = IGNORE_INDEX  # a row without a target
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("tied,frozen_head", [(False, False), (True, False), (False, True)])
def test_loss_head_gives_the_full_loss_and_gradients_of_a_real_model(tied, frozen_head):
    batch = _batch()
    results = []
    for chunked in (False, True):
        model = _model(tied, chunked, frozen_head)
        loss = L.loss_sum(model, batch)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        with torch.no_grad():  # eval: the same loss, no gradient work
            evaluated = L.loss_sum(model, batch)
        logprobs = L.sequence_logprobs(model, batch)
        logits = model(input_ids=batch["input_ids"]).logits  # generation: the plain head
        results.append((loss, evaluated, logprobs, logits, grads))
    (loss, ev, lp, logits, grads), (c_loss, c_ev, c_lp, c_logits, c_grads) = results
    assert logits.shape == c_logits.shape == (3, 32, TINY["vocab_size"])
    torch.testing.assert_close(c_loss, loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(c_ev, ev, rtol=1e-6, atol=0)
    torch.testing.assert_close(c_lp, lp, rtol=1e-6, atol=1e-6)
    assert lp[2] == 0 and -lp[:2].sum().item() == pytest.approx(loss.item(), rel=1e-6)
    assert c_grads.keys() == grads.keys()
    assert ("lm_head.weight" in grads) == (not frozen_head and not tied)
    for name, g in grads.items():
        torch.testing.assert_close(c_grads[name], g, rtol=1e-5, atol=1e-6 * g.abs().max().item(),
                                   msg=name)


def test_a_host_tensor_for_the_cpu_stays_as_it_is():
    """transfer.to_device pins only for a CUDA copy: a CPU run's batch is the same tensor."""
    from llama_fsdp.model.transfer import to_device

    t = torch.arange(6)
    assert to_device(t, torch.device("cpu")) is t
