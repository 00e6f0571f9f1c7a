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


def _model(attn):
    from transformers import LlamaForCausalLM

    from llama_fsdp.config import ModelConfig
    from llama_fsdp.model import llama_config

    m = ModelConfig(name="t", hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2,
                    intermediate_size=1024, vocab_size=512, max_position_embeddings=1024,
                    attn_implementation=attn)
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(m)).to("cuda", torch.bfloat16)


def test_flash_varlen_equals_sdpa_with_the_block_mask():
    from llama_fsdp.attention import model_inputs, varlen_available

    assert varlen_available(), f"torch {torch.__version__} has no varlen_attn"
    batch, dev = _packed_batch(), torch.device("cuda")
    out = {}
    for attn in ("sdpa", "varlen"):
        model = _model(attn)
        logits = model(**model_inputs(model, batch, dev)).logits
        logits.float().logsumexp(-1).mean().backward()
        out[attn] = logits.float(), [p.grad.float() for p in model.parameters()]
    torch.testing.assert_close(out["varlen"][0], out["sdpa"][0], atol=3e-2, rtol=3e-2)
    for a, b in zip(out["varlen"][1], out["sdpa"][1]):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=5e-2)


def test_varlen_step_makes_no_host_sync():
    from llama_fsdp.attention import model_inputs

    model = _model("varlen")
    inputs = model_inputs(model, _packed_batch(), torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(**inputs).logits.float().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
