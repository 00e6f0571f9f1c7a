"""varlen attention on CUDA: flash over the packed records equals SDPA with transformers' dense
block mask, and the step it runs in makes no host sync.

Skipped without CUDA (CI never has one); run on a GPU machine with `pytest -m gpu tests/gpu`.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _packed_batch(b=4, s=512, vocab=512, seed=0):
    """Rows of records of 17..200 tokens, position_ids restarting per record."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    pos = torch.empty(b, s, dtype=torch.long)
    for r in range(b):
        at = 0
        while at < s:
            n = min(int(torch.randint(17, 200, (1,), generator=g)), s - at)
            pos[r, at:at + n] = torch.arange(n)
            at += n
    return {"input_ids": ids, "position_ids": pos}


def _model(attn, dtype=torch.bfloat16):
    from transformers import LlamaForCausalLM

    from llama_fsdp.config.schema import ModelConfig
    from llama_fsdp.model.llama import llama_config

    m = ModelConfig(name="t", hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2,
                    intermediate_size=1024, vocab_size=512, max_position_embeddings=1024,
                    attn_implementation=attn)
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(m)).to("cuda", dtype)


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "fp32-autocast"])
def test_flash_varlen_equals_sdpa_with_the_block_mask(autocast):
    """bf16 weights (FSDP2's cast), and fp32 weights under bf16 autocast (no_shard's DDP with
    precision=mixed, where RoPE leaves q, k in fp32 beside a bf16 v)."""
    from llama_fsdp.model.attention import model_inputs, varlen_available

    assert varlen_available(), f"torch {torch.__version__} has no varlen_attn"
    batch, dev = _packed_batch(), torch.device("cuda")
    out = {}
    for attn in ("sdpa", "varlen"):
        model = _model(attn, torch.float32 if autocast else torch.bfloat16)
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            logits = model(**model_inputs(model, batch, dev)).logits
        logits.float().logsumexp(-1).mean().backward()
        out[attn] = logits.float(), [p.grad.float() for p in model.parameters()]
    torch.testing.assert_close(out["varlen"][0], out["sdpa"][0], atol=3e-2, rtol=3e-2)
    # elementwise bf16 tolerances would pass gradients that ignore the record bounds: compare
    # each parameter's gradient by its relative error norm. On CPU, this model and batch: bf16
    # against fp32 is 0.003-0.013 per parameter, with the bounds ignored 0.70-2.06 (SDPA, CPU)
    for (name, _), a, b in zip(_model("sdpa").named_parameters(), out["varlen"][1],
                               out["sdpa"][1]):
        rel = float((a - b).norm() / b.norm().clamp(min=1e-12))
        assert rel < 0.1, f"{name}: relative gradient error {rel:.3g}"


@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp2"])
def test_varlen_step_makes_no_host_sync(fsdp, request):
    """Forward and backward over packed rows without a host sync; under FSDP2 too, whose root
    moves every tensor argument to the device (why the bounds do not travel as one)."""
    from llama_fsdp.model.attention import model_inputs

    model = _model("varlen")
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        request.getfixturevalue("one_rank_group")
        mesh = init_device_mesh("cuda", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(**model_inputs(model, _packed_batch(), torch.device("cuda"))).logits.sum().backward()
    inputs = model_inputs(model, _packed_batch(), torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(**inputs).logits.float().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
