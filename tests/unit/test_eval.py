"""Held-out evaluation: exact match of greedy answers (KV-cached generation in lockstep)."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaForCausalLM

from llama_fsdp.config.schema import DataConfig, ModelConfig
from llama_fsdp.data import SYNTHETIC_TASKS, build_data
from llama_fsdp.model.generate import greedy_generate
from llama_fsdp.objective.sft import exact_match, task_prompts
from llama_fsdp.model.llama import llama_config


class Oracle(torch.nn.Module):
    """Answers every held-out prompt with its reference (or a wrong first token). Like a model
    with a KV cache, it is given the prompt once, then one new token per call."""

    def __init__(self, dm, wrong: bool = False):
        super().__init__()
        store, self.vocab, self.pad = dm.eval.store, len(dm.tokenizer), dm.tokenizer.pad_token_id
        self.table = {}
        for i in range(len(store)):
            x, _ = store.record(i)
            p = int(store.prompt_len[i])
            self.table[tuple(x[:p].tolist())] = x[p:].tolist()
        self.wrong, self.calls, self.seqs = wrong, 0, []

    def forward(self, input_ids, attention_mask, position_ids, use_cache, logits_to_keep,
                **cache):
        self.calls += 1
        if input_ids.shape[1] == attention_mask.shape[1]:  # the prompts: a new batch
            self.seqs = [input_ids[i][attention_mask[i].bool()].tolist()
                         for i in range(input_ids.shape[0])]
        else:
            for i, seq in enumerate(self.seqs):
                seq.append(int(input_ids[i, -1]))
        out = torch.full((input_ids.shape[0], 1, self.vocab), -1e9)
        for i, ids in enumerate(self.seqs):
            plen = next(n for n in range(len(ids), 0, -1) if tuple(ids[:n]) in self.table)
            answer, k = self.table[tuple(ids[:plen])], len(ids) - plen
            nxt = answer[k] if k < len(answer) else self.pad
            if self.wrong and k == 0:
                nxt = (nxt + 1) % self.vocab
            out[i, 0, nxt] = 0.0
        return SimpleNamespace(logits=out)


def test_oracle_scores_one_and_wrong_scores_zero(dm):
    oracle = Oracle(dm)
    res = exact_match(oracle, dm, device=torch.device("cpu"), max_prompts=30)
    assert res["exact_match"] == 1.0
    kinds = {k for k in res if k.startswith("exact_match/")}
    assert kinds and kinds <= {f"exact_match/{k}" for k in SYNTHETIC_TASKS}
    wrong = exact_match(Oracle(dm, wrong=True), dm, device=torch.device("cpu"), max_prompts=30)
    assert wrong["exact_match"] == 0.0
    # ceil(30 / micro_batch 4) = 8 batches, each decoded until its longest answer (with its
    # EOS) has ended, not for the longest answer of all: one forward over the prompts, then one
    # per token
    lengths = [p[3] for p in task_prompts(dm.eval.store, dm.tokenizer, 30)]
    per_batch = [max(lengths[i:i + 4]) for i in range(0, 30, 4)]
    assert len(per_batch) == 8 and oracle.calls == sum(per_batch) < 8 * max(lengths)


def test_exact_match_scores_only_short_answers_and_decodes_no_further(dm):
    """An answer longer than the bound is left out, not decoded for and counted wrong."""
    oracle = Oracle(dm)
    lengths = [p[3] for p in task_prompts(dm.eval.store, dm.tokenizer, None)]  # EOS counted
    bound = min(lengths)
    short = [n for n in lengths if n <= bound]
    # some answers are longer than the bound decodes (an answer of bound tokens without its EOS
    # would still read the same: not those)
    assert 0 < len(short) and any(n > bound + 1 for n in lengths)
    res = exact_match(oracle, dm, device=torch.device("cpu"), max_prompts=None,
                      max_new_tokens=bound)
    assert res["exact_match"] == 1.0  # every scored answer fits: all match
    assert oracle.calls <= bound * -(-len(short) // 4)


def test_text_data_has_no_task_metric(tmp_path, cache):
    f = tmp_path / "t.jsonl"
    f.write_text("".join(f'{{"text": "line {i} of text"}}\n' for i in range(30)))
    dm = build_data(DataConfig(name="jsonl", path=str(f), eval_records=5), seq_len=64, micro_batch=2,
                    dp_rank=0, dp_world=1, seed=0, cache_dir=cache, vocab_size=512)
    assert exact_match(Oracle(dm), dm, device=torch.device("cpu")) == {}


@pytest.mark.parametrize("attn", ["sdpa", "varlen"])
def test_cached_batched_generation_equals_transformers_generate(dm, attn):
    """Left-padded, batched, KV-cached greedy decoding gives what transformers' own generate
    gives for each prompt alone (no padding, its own cache handling); a varlen model (packed
    training attention) generates through SDPA and is varlen again afterwards."""
    m = ModelConfig(name="t", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=128, vocab_size=512, max_position_embeddings=256,
                    attn_implementation=attn)
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(m)).eval()
    tok, store = dm.tokenizer, dm.eval.store
    prompts = [store.record(i)[0][: int(store.prompt_len[i])] for i in range(6)]
    assert len({len(p) for p in prompts}) > 1  # the batch needs padding
    with _no_deprecations():  # our calls into transformers use its current API
        batched = greedy_generate(model, prompts, tok, device=torch.device("cpu"), steps=5)
    assert model.config._attn_implementation == attn
    model.config._attn_implementation = "sdpa"  # transformers' generate, for the reference
    for p, got in zip(prompts, batched):
        ids = torch.from_numpy(p.astype("int64"))[None]
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                             do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
        if tok.eos_token_id in ref:
            ref = ref[:ref.index(tok.eos_token_id)]
        assert got == tok.decode(ref, skip_special_tokens=True).strip()


@contextlib.contextmanager
def _no_deprecations():
    """Warnings are errors, and so is a deprecation transformers reports through its logger
    (``warning_once``: "`past_key_values`/`cache_params` are deprecated. Use `cache` instead.")."""
    import logging
    import warnings

    class Raise(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "deprecat" in record.getMessage().lower():
                raise AssertionError(f"deprecated call: {record.getMessage()}")

    handler, logger = Raise(), logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield
    finally:
        logger.removeHandler(handler)
