"""nf4.linear, the NF4 linear of finetune=qlora: bit for bit torchao's linear_nf4 (forward and
the input's gradient), and one call's temporaries are one chunk's beside its one result."""
from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llama_fsdp.config import nf4 as nf4_layout
from llama_fsdp.model import nf4

GROUP = 64 * 256  # torchao's default block x scaler block: the smallest chunk


def _weight(shape, dtype, seed=0):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return nf4.nf4_module().to_nf4(w, 64, 256)


def _forward_backward(fn, q, x_dtype, seed=1):
    x = torch.randn(3, 5, q.shape[1], generator=torch.Generator().manual_seed(seed))
    x = x.to(x_dtype).requires_grad_(True)
    y = fn(x, q)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1))
               .to(y.dtype))
    return y.detach(), x.grad


# (shape, chunk): rows of 384 columns do not fit a chunk of two groups evenly, and 3 groups
# leave a last chunk of one; 1,088 x 1,024 is two chunks of 2^20, the last one short.
CASES = [((256, 64), nf4_layout.DEQUANT_CHUNK), ((128, 384), 2 * GROUP), ((96, 512), 2 * GROUP),
         ((1088, 1024), 1 << 20)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,chunk", CASES)
def test_linear_is_torchaos_bit_for_bit(monkeypatch, dtype, shape, chunk):
    monkeypatch.setattr(nf4_layout, "DEQUANT_CHUNK", chunk)
    q = _weight(shape, dtype)
    assert torch.equal(nf4.dequantize(q, dtype), q.get_original_weight())
    want = _forward_backward(nf4.nf4_module().linear_nf4, q, dtype)
    got = _forward_backward(nf4.linear, q, dtype)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (shape, dtype)


def test_a_bf16_weight_under_fp32_inputs_is_torchaos_cast():
    q = _weight((96, 512), torch.bfloat16)
    want = _forward_backward(nf4.nf4_module().linear_nf4, q, torch.float32)
    got = _forward_backward(nf4.linear, q, torch.float32)
    assert got[0].dtype == torch.float32
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class _Allocations(TorchDispatchMode):
    """Every tensor an op makes in fresh storage (not a view, not in place): its bytes, and the
    high-water mark of those bytes alive at once."""

    def __init__(self):
        super().__init__()
        self.made, self.live, self.peak = [], 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves(
            (args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                n = t.untyped_storage().nbytes()
                self.made.append((n, t.dtype, func))
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._freed, n)
        return out

    def _freed(self, n):
        self.live -= n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_call_holds_its_result_and_one_chunk(monkeypatch, dtype):
    """Forward and backward each make one weight-sized buffer; everything else they make is a
    chunk's, and at most one weight plus (8 + 2c) bytes a chunk element is alive at once
    (torchao's get_original_weight, seen by the same count: (8 + 3c) bytes a weight)."""
    chunk = 2 * GROUP
    monkeypatch.setattr(nf4_layout, "DEQUANT_CHUNK", chunk)
    q = _weight((1024, 256), dtype)  # 8 groups: 4 chunks
    n, c = q.numel(), torch.finfo(dtype).bits // 8
    x = torch.randn(2, 256, dtype=dtype, requires_grad=True)
    for fn, lean in ((nf4.linear, True), (nf4.nf4_module().linear_nf4, False)):
        with _Allocations() as fwd:
            y = fn(x, q)
        with _Allocations() as bwd:
            y.sum().backward()
        for seen in (fwd, bwd):
            big = sorted(b for b, _, _ in seen.made)
            if lean:
                assert big[-1] == n * c and big[-2] <= 8 * chunk, (dtype, big[-3:])
                assert n * c < seen.peak <= nf4_layout.dequantize_bytes(
                    n, dtype_bytes=c, block_size=64, scaler_block_size=256) + 4096, seen.peak
                assert not [d for b, d, _ in seen.made if d == torch.int64 and b >= 8 * n]
            else:  # the instrument sees torchao's whole-weight int64 codes
                assert seen.peak >= (8 + 3 * c) * n, seen.peak


def test_a_compiled_qlora_projection_is_one_graph_with_the_eager_numbers():
    """train.compile=true compiles each layer: its LoRALinear traces whole (no graph break;
    under compile nf4.linear is torchao's linear_nf4) and, without inductor's fusion
    (aot_eager), gives the eager numbers bit for bit."""
    from llama_fsdp.model.lora import LoRALinear

    layer = LoRALinear(256, 128, rank=4, alpha=8, dropout=0.0)
    torch.nn.init.normal_(layer.lora_A.weight)
    torch.nn.init.normal_(layer.lora_B.weight)
    layer.weight = torch.nn.Parameter(_weight((128, 256), torch.float32), requires_grad=False)
    layer.nf4 = True
    explained = torch._dynamo.explain(layer)(torch.randn(2, 256))
    assert explained.graph_count == 1 and explained.graph_break_count == 0, \
        explained.break_reasons
    eager = _forward_backward(lambda x, _: layer(x), layer.weight, torch.float32)
    compiled = torch.compile(layer, backend="aot_eager", dynamic=False)
    got = _forward_backward(lambda x, _: compiled(x), layer.weight, torch.float32)
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
