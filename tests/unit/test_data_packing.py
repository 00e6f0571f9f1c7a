"""Masking, packing and the block-causal attention of packed rows."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from llama_fsdp.model.attention import (
    additive_chunks,
    block_sparse_attention,
    chunk_plan,
    document_bounds,
    model_inputs,
    standard_attention,
)
from llama_fsdp.config.schema import DataConfig, ModelConfig
from llama_fsdp.data import IGNORE_INDEX, build_data, pack
from llama_fsdp.model.llama import llama_config

ALPACA = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"
WORDS = "cat dog sun moon tree fish bird star rain snow wind fire rock leaf ship king".split()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "data-cache"


def _records(n: int, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    out = []
    for _ in range(n):
        rec = {"instruction": " ".join(r.choices(WORDS, k=r.randint(1, 6))),
               "input": " ".join(r.choices(WORDS, k=r.randint(0, 8))),
               "output": " ".join(r.choices(WORDS, k=r.randint(1, 10)))}
        out.append(rec)
    return out


def _write(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _module(tmp_path, cache, *, packing=True, train_on_prompt=False, seq_len=128, n=120, world=1,
            rank=0, micro_batch=1):
    f = _write(tmp_path / "d.jsonl", _records(n))
    cfg = DataConfig(name="jsonl", path=str(f), packing=packing, train_on_prompt=train_on_prompt,
                     eval_records=10, prompt_template=ALPACA, prompt_template_no_input=ALPACA_NO_INPUT)
    return build_data(cfg, seq_len=seq_len, micro_batch=micro_batch, dp_rank=rank, dp_world=world,
                      seed=0, cache_dir=cache, vocab_size=512)


def _epoch_rows(dm):
    """All rows of one epoch (single rank), as (input_ids, labels, position_ids) numpy arrays."""
    it = dm.train_batches()
    batches = [next(it) for _ in range(dm.batches_per_epoch)]
    return [np.concatenate([b[k].numpy() for b in batches])
            for k in ("input_ids", "labels", "position_ids")]


def _documents(ids, labels, pos):
    """Split packed rows back into documents (position 0 starts one), dropping padding."""
    docs = []
    for r in range(ids.shape[0]):
        starts = list(np.flatnonzero(pos[r] == 0)) + [ids.shape[1]]
        for a, b in zip(starts, starts[1:]):
            # a record ends at its EOS; what follows (padding) continues its positions
            eos = a + int(np.flatnonzero(ids[r, a:b] == 2)[-1]) + 1
            docs.append((tuple(ids[r, a:eos]), tuple(labels[r, a:eos]), (r, a, eos)))
    return docs


def test_pack_keeps_every_record_once_and_fits():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, size=500)
    rows = pack(lengths, 128)
    flat = sorted(d for r in rows for d in r)
    assert flat == list(range(500))
    assert all(sum(lengths[d] for d in r) <= 128 for r in rows)
    # close to the lower bound on the number of rows
    assert len(rows) <= int(np.ceil(lengths.sum() / 128)) * 1.05 + 1
    with pytest.raises(ValueError, match="does not fit"):
        pack(np.array([10, 200]), 128)


def test_no_token_lost_or_duplicated(tmp_path, cache):
    dm = _module(tmp_path, cache)
    assert dm.stats["records_truncated"] == 0
    ids, labels, pos = _epoch_rows(dm)
    assert dm.batches_per_epoch == dm.stats["train_rows"]  # 1 rank, micro-batch 1: every row
    docs = _documents(ids, labels, pos)
    store = dm.train.store
    expected = sorted(tuple(store.record(i)[0].tolist()) for i in range(len(store)))
    assert sorted(d[0] for d in docs) == expected
    assert sum(len(d[0]) for d in docs) == dm.stats["train_tokens"]


def test_labels_are_shifted_and_masked_on_prompt_and_pad(tmp_path, cache):
    dm = _module(tmp_path, cache)
    tok = dm.tokenizer
    ids, labels, pos = _epoch_rows(dm)
    n_docs = 0
    for doc_ids, doc_labels, (r, a, b) in _documents(ids, labels, pos):
        n_docs += 1
        text = tok.decode(list(doc_ids))
        plen = next(i for i in range(len(doc_ids))
                    if tok.decode(list(doc_ids[:i + 1])).endswith("Response:\n"))
        assert pos[r, a:b].tolist() == list(range(b - a))  # positions restart per record
        # prompt targets are ignored; response targets are the next tokens, EOS included
        assert all(l == IGNORE_INDEX for l in doc_labels[:plen])
        assert list(doc_labels[plen:-1]) == list(doc_ids[plen + 1:])
        assert doc_labels[-1] == IGNORE_INDEX  # nothing after a record's EOS is predicted
        assert "### Response:\n" in text
    assert n_docs == dm.stats["train_records"]
    # padding: no labels
    pad_cols = np.ones_like(ids, dtype=bool)
    for _, _, (r, a, b) in _documents(ids, labels, pos):
        pad_cols[r, a:b] = False
    assert (labels[pad_cols] == IGNORE_INDEX).all() and (ids[pad_cols] == tok.pad_token_id).all()
    assert dm.stats["train_target_tokens"] == (labels != IGNORE_INDEX).sum()


def test_train_on_prompt_labels_everything_but_the_first_token(tmp_path, cache):
    dm = _module(tmp_path, cache, train_on_prompt=True)
    ids, labels, pos = _epoch_rows(dm)
    for doc_ids, doc_labels, _ in _documents(ids, labels, pos):
        assert list(doc_labels[:-1]) == list(doc_ids[1:])


def test_padding_mode_one_record_per_row(tmp_path, cache):
    packed = _module(tmp_path, cache)
    padded = _module(tmp_path, cache, packing=False)
    ids, labels, pos = _epoch_rows(padded)
    assert (pos == np.arange(ids.shape[1])).all()  # plain causal rows
    assert all(len(np.flatnonzero(r == 2)) == 1 for r in ids)
    assert padded.stats["train_rows"] == padded.stats["train_records"]
    assert padded.stats["packing_efficiency"] < packed.stats["packing_efficiency"]
    assert packed.stats["packing_efficiency"] > 0.9


def _logits(model, ids, pos=None):
    """The model's logits through the worker's input path (varlen gets the records' bounds)."""
    if pos is None:
        pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    return model(**model_inputs(model, {"input_ids": ids, "position_ids": pos},
                                torch.device("cpu"))).logits


def _tiny_llama(attn):
    m = ModelConfig(name="t", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=128, vocab_size=512, max_position_embeddings=256,
                    attn_implementation=attn)
    torch.manual_seed(0)
    config = llama_config(m)
    # a KV cache would switch off transformers' packed-sequence detection
    assert config.use_cache is False
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("attn", ["sdpa", "eager", "varlen"])
def test_packed_logits_equal_unpacked(tmp_path, cache, attn):
    """Packed records do not attend to each other, so each record's logits are what it gets
    alone: transformers' block-causal mask from restarting position_ids (sdpa, eager), or the
    records' bounds (varlen: block-sparse SDPA here on CPU, flash on CUDA)."""
    dm = _module(tmp_path, cache, seq_len=160, n=40, micro_batch=4)
    model = _tiny_llama(attn).eval()
    assert model.config._attn_implementation == attn
    batch = next(dm.train_batches())
    with torch.no_grad():
        packed = _logits(model, batch["input_ids"], batch["position_ids"])
        plain = _logits(model, batch["input_ids"])  # no restarts: attends across records
        checked = 0
        for r in range(batch["input_ids"].shape[0]):
            pos = batch["position_ids"][r].numpy()
            starts = list(np.flatnonzero(pos == 0)) + [len(pos)]
            assert len(starts) > 2  # the row holds several records
            for a, b in zip(starts, starts[1:]):
                alone = _logits(model, batch["input_ids"][r:r + 1, a:b])[0]
                torch.testing.assert_close(packed[r, a:b], alone, atol=2e-5, rtol=1e-4)
                checked += 1
        assert checked > 8
        assert not torch.allclose(packed, plain, atol=1e-3)


def test_varlen_bounds_are_transformers_segments(tmp_path, cache):
    """document_bounds splits rows where transformers' find_packed_sequence_indices does (the
    padding tail joins the last record), and varlen's gradients equal SDPA's with its mask."""
    from transformers.masking_utils import find_packed_sequence_indices

    dm = _module(tmp_path, cache, seq_len=160, n=40, micro_batch=4)
    batch = next(dm.train_batches())
    pos = batch["position_ids"]
    bounds = document_bounds(pos)
    cu = bounds.cu.numpy()
    seg = find_packed_sequence_indices(pos).numpy()  # segment index per token, per row
    starts = np.flatnonzero(np.diff(seg, axis=1, prepend=-1).ravel() != 0)
    assert cu.dtype == np.int32 and cu.tolist() == [*starts.tolist(), pos.numel()]
    assert bounds.longest == int(np.diff(cu).max()) and bounds.tokens == pos.numel()
    grads = {}
    for attn in ("sdpa", "varlen"):
        model = _tiny_llama(attn)
        loss = _logits(model, batch["input_ids"], pos).float().logsumexp(-1).mean()
        loss.backward()
        grads[attn] = [p.grad for p in model.parameters()]
    for a, b in zip(grads["sdpa"], grads["varlen"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def _rows(*layouts):
    """position_ids of rows made of records of the given lengths; ("pad", n) continues the
    last record's positions for n tokens, as the packer pads a row."""
    rows = []
    for layout in layouts:
        parts = []
        for n in layout:
            if isinstance(n, tuple):
                last = int(parts[-1][-1])
                parts.append(torch.arange(last + 1, last + 1 + n[1]))
            else:
                parts.append(torch.arange(n))
        rows.append(torch.cat(parts))
    return torch.stack(rows)


@pytest.mark.parametrize("size", [None, 8, 32, 40, 96])
@pytest.mark.parametrize("additive", [False, True])
def test_block_sparse_attention_is_the_dense_mask(size, additive):
    """varlen off CUDA: each query chunk attends to its key window only, under that window's
    block-causal mask (bool, or additive as the model runs it). Outputs and q / k / v
    gradients equal SDPA's with the dense mask of transformers' segments, at any chunk size
    (None: the cost model's pick; 40: a last chunk shorter; 96: one chunk of the whole row): a
    record longer than a chunk, a padding tail, a row whose positions do not start at 0, rows
    of other layouts, grouped-query heads."""
    from transformers.masking_utils import find_packed_sequence_indices

    pos = _rows([96], [5, 40, 3, 30, 18], [10] * 9 + [("pad", 6)], [20, 76])
    pos[3, :20] += 7  # a record continued from an earlier row: positions 7..26
    b, s = pos.shape
    h, kv, d = 4, 2, 8
    seg = find_packed_sequence_indices(pos)
    idx = torch.arange(s)
    dense = ((seg[:, :, None] == seg[:, None, :]) & (idx[:, None] >= idx[None, :]))[:, None]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=gen, dtype=torch.float64, requires_grad=True)
               for n in (h, kv, kv))
    grad = torch.randn(b, s, h, d, generator=gen, dtype=torch.float64)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=dense, enable_gqa=True).transpose(1, 2)
    plan = chunk_plan(pos, heads=h, kv_heads=kv, head_dim=d, size=size)
    assert [a for a, *_ in plan] == list(range(0, s, plan[0][1]))  # the row, chunk by chunk
    chunks = [(a, z, lo, torch.from_numpy(m)) for a, z, lo, m in plan]
    if additive:
        chunks = additive_chunks(chunks, torch.float64)
    got = block_sparse_attention(q, k, v, chunks, None)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), grad),
                    torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10)


def test_block_sparse_plan_skips_the_scores_records_cannot_see():
    """Rows of short records: the windows hold a fraction of the s x s scores SDPA's dense mask
    computes (and of causal's s²/2); one record per row: about causal's half."""
    short = _rows(*([[12] * 42 + [8]] * 4))  # 512 tokens in records of 12
    long = _rows(*([[512]] * 4))
    scores = {}
    for name, pos in (("short", short), ("long", long)):
        plan = chunk_plan(pos, heads=32, kv_heads=8, head_dim=64)
        scores[name] = sum((z - a) * (z - lo) for a, z, lo, _ in plan) / 512 ** 2
    assert scores["short"] < 0.15
    assert 0.5 <= scores["long"] < 0.6


def test_varlen_without_bounds_says_how_to_call_it(monkeypatch):
    """A varlen model called without model_inputs is refused, not run on records read from
    its position_ids: transformers drops a padding mask before a kernel without a mask
    function sees it. The bounds are made once per batch: no layer, and no recomputing
    backward, plans the chunks again."""
    from llama_fsdp.model import attention

    model = _tiny_llama("varlen").eval()
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(RuntimeError, match="model_inputs"):
        model(input_ids=ids)
    with pytest.raises(RuntimeError, match="standard_attention"):  # a padded batch
        model(input_ids=ids, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]]))
    with standard_attention(model):  # what generation uses: SDPA for its duration
        assert model(input_ids=ids).logits.shape == (1, 8, 512)
        cached = model(input_ids=ids, use_cache=True).past_key_values
    assert model.config._attn_implementation == "varlen"
    with pytest.raises(RuntimeError, match="no record bounds"):  # a KV-cache step
        model(input_ids=ids[:, :1], past_key_values=cached, use_cache=True)
    # the bounds travel beside the forward, not in it: FSDP2's root would move a tensor
    # argument to the device (a host sync per layer to read the longest record back)
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    plans, plan_chunks = [], attention._chunks
    monkeypatch.setattr(attention, "_chunks", lambda *a: plans.append(1) or plan_chunks(*a))
    inputs = model_inputs(model, batch, torch.device("cpu"))
    assert inputs.keys() == {"input_ids", "position_ids"}  # one record per row, from arange
    trained = _tiny_llama("varlen")
    for i, layer in enumerate(trained.model.layers):  # backward recomputes every layer
        trained.model.layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
    trained(**model_inputs(trained, batch, torch.device("cpu"))).logits.sum().backward()
    assert len(plans) == 2  # once per model_inputs call
    assert model(**inputs).logits.shape == (2, 16, 512)
    with pytest.raises(RuntimeError, match="no record bounds for this batch"):  # not 2 x 16
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    # same shape, but not the batch the bounds were made for: refused, not run on its records
    other = {"input_ids": torch.ones(2, 16, dtype=torch.long),
             "position_ids": torch.arange(16).expand(2, -1)}
    with pytest.raises(RuntimeError, match="no record bounds for this batch"):
        model(**other)
    with pytest.raises(ValueError, match="not a padding attention_mask"):
        model_inputs(model, {**batch, "attention_mask": torch.ones(2, 16)}, torch.device("cpu"))
    monkeypatch.setattr(attention, "_use_flash", lambda q: True)  # CUDA's kernel
    with pytest.raises(RuntimeError, match="model_inputs"):
        model(input_ids=ids)


def _fake_varlen(kind):
    """torch's CUDA-only varlen_attn, as its three signatures document it ((T, H, D) tokens,
    cumulative lengths, causal by window_size or is_causal, GQA only with enable_gqa), computed
    here per record with SDPA: the stand-in for the kernel a CPU cannot run."""
    def compute(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale=None, enable_gqa=False):
        assert causal and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
        assert q.dtype == k.dtype == v.dtype, "flash takes one dtype"
        if k.shape[1] != q.shape[1]:
            assert enable_gqa, "k/v have fewer heads than q without enable_gqa"
        out = torch.empty_like(q)
        for a, b in zip(cu_q.tolist(), cu_q[1:].tolist()):
            h = lambda t: t[a:b].transpose(0, 1)  # noqa: E731
            out[a:b] = torch.nn.functional.scaled_dot_product_attention(
                h(q), h(k), h(v), is_causal=True, scale=scale,
                enable_gqa=enable_gqa).transpose(0, 1)
        return out

    if kind == "2.13":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                        scale=None, window_size=(-1, -1), enable_gqa=False):
            return compute(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                           window_size == (-1, 0), scale, enable_gqa)
    elif kind == "2.11":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                        scale=None, window_size=(-1, -1)):
            return compute(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                           window_size == (-1, 0), scale)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                        return_aux=None):
            return compute(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal)
    return varlen_attn


@pytest.mark.parametrize("kind", ["2.13", "2.11", "2.10", "autocast"])
def test_flash_path_adapts_to_each_varlen_signature(tmp_path, cache, monkeypatch, kind):
    """The CUDA branch (flattening, GQA by enable_gqa or by repeating k/v in repeat_kv's
    order, the causal switch, the scale) gives SDPA's logits with every varlen_attn signature
    torch has had; the kernel itself is a CPU stand-in (the GPU suite runs the real one).
    ``autocast``: fp32 weights under bf16 autocast (sharding=no_shard, precision=mixed), where
    RoPE hands over fp32 q, k beside a bf16 v: the branch casts them to one dtype."""
    amp = kind == "autocast"
    kind = "2.13" if amp else kind
    from llama_fsdp.model import attention

    monkeypatch.setattr(attention, "_VARLEN_ATTN", _fake_varlen(kind))
    causal, gqa, scale = attention._signature()
    assert gqa == (kind == "2.13") and scale == (kind != "2.10")
    monkeypatch.setattr(attention, "_CAUSAL", causal)
    monkeypatch.setattr(attention, "VARLEN_GQA", gqa)
    monkeypatch.setattr(attention, "_TAKES_SCALE", scale)
    monkeypatch.setattr(attention, "_use_flash", lambda q: True)
    dm = _module(tmp_path, cache, seq_len=160, n=40, micro_batch=4)
    batch = next(dm.train_batches())
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=amp):
        want = _logits(_tiny_llama("sdpa").eval(), batch["input_ids"], batch["position_ids"])
        got = _logits(_tiny_llama("varlen").eval(), batch["input_ids"], batch["position_ids"])
    tol = {"atol": 3e-2, "rtol": 3e-2} if amp else {"atol": 2e-5, "rtol": 1e-4}
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_compiled_layers_are_not_recompiled_per_batch(tmp_path, cache):
    """train.compile compiles each layer with static shapes; the number of records and the
    longest one change every batch, and must not each cost a recompile (8 of them and torch
    falls back to eager). Dynamo's guards do not depend on the backend: eager keeps it quick."""
    import torch._dynamo

    dm = _module(tmp_path, cache, seq_len=160, n=40, micro_batch=4)
    batches = [b for b, _ in zip(dm.train_batches(), range(3))]
    counts = {len(document_bounds(b["position_ids"]).cu) for b in batches}
    assert len(counts) == 3  # three different numbers of records
    model = _tiny_llama("varlen").eval()
    want = [_logits(model, b["input_ids"], b["position_ids"]) for b in batches]
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer, dynamic=False, backend="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        first = _logits(model, batches[0]["input_ids"], batches[0]["position_ids"])
        with torch._dynamo.config.patch(error_on_recompile=True):
            rest = [_logits(model, b["input_ids"], b["position_ids"]) for b in batches[1:]]
    for got, ref in zip([first, *rest], want):
        torch.testing.assert_close(got, ref.detach(), atol=2e-5, rtol=1e-4)
