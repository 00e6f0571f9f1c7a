"""Data on real gloo ranks (one spawn, to keep it quick): concurrent cache builds, disjoint
shares, and the task metric on an FSDP2-sharded model."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _on_rank(rank, world, cache):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from llama_fsdp.config.schema import DataConfig, ModelConfig
    from llama_fsdp.data import build_data
    from llama_fsdp.model.generate import greedy_generate
    from llama_fsdp.objective.sft import exact_match, task_prompts
    from llama_fsdp.model.llama import llama_config

    # every rank builds at once into an empty cache
    dm = build_data(DataConfig(num_records=400, eval_records=30), seq_len=64, micro_batch=2,
                    dp_rank=rank, dp_world=world, seed=0, cache_dir=Path(cache), vocab_size=512)
    it = dm.train_batches()
    rows = [tuple(r.tolist()) for _ in range(dm.batches_per_epoch) for r in next(it)["input_ids"]]
    out = {"from_cache": dm.stats["tokenized_from_cache"], "rows": rows,
           "n_rows": dm.stats["train_rows"], "eval_batches": len(dm.eval_batches())}

    # the task metric: the same answers sharded as unsharded, the same number of forward calls
    m = ModelConfig(name="t", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=128, vocab_size=512, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(m))
    prompts = task_prompts(dm.eval.store, dm.tokenizer, 7)
    cpu = torch.device("cpu")
    reference = greedy_generate(model.eval(), [p[0] for p in prompts], dm.tokenizer, device=cpu,
                                steps=4)
    out["expected"] = sum(r == p[1] for r, p in zip(reference, prompts)) / len(prompts)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    mine = [p[0] for p in prompts[rank * 4:(rank + 1) * 4]]  # 4 and 3 prompts: one batch each
    out["sharded_ok"] = greedy_generate(model, mine, dm.tokenizer, device=cpu, steps=4) == \
        reference[rank * 4:(rank + 1) * 4]
    # 7 prompts, micro-batch 2: rank 1 answers an uncounted stand-in to keep calls equal
    out["metric"] = exact_match(model, dm, device=cpu, max_prompts=7, max_new_tokens=4)
    # decoding until every prompt on every rank has ended: rank 0's ends at its 3rd forward,
    # rank 1's at its 6th; both run 6 (the all-reduce a token keeps FSDP's ranks in lockstep)
    ends = _EndsAfter(3 if rank == 0 else 6, dm.tokenizer.eos_token_id, 512)
    greedy_generate(ends, [p[0] for p in prompts[:2]], dm.tokenizer, device=cpu, steps=20,
                    until_all_done=True)
    out["forwards"] = ends.calls
    return out


class _EndsAfter:
    """A stand-in model whose every prompt ends (EOS) at its ``n``-th forward call."""

    def __init__(self, n: int, eos: int, vocab: int):
        self.n, self.eos, self.vocab, self.calls = n, eos, vocab, 0

    def __call__(self, input_ids, **_):
        import types

        import torch

        self.calls += 1
        logits = torch.zeros(input_ids.shape[0], 1, self.vocab)
        logits[:, 0, self.eos if self.calls >= self.n else 7] = 1.0
        return types.SimpleNamespace(logits=logits)


def test_data_on_two_gloo_ranks(tmp_path):
    r0, r1 = run_ranks(_on_rank, 2, str(tmp_path))
    # one rank tokenized (and trained the tokenizer), the other waited on the lock and reused it
    assert sorted([r0["from_cache"], r1["from_cache"]]) == [0.0, 1.0]
    assert len([p for p in (tmp_path / "data").iterdir() if p.is_dir()]) == 1
    assert len([p for p in (tmp_path / "tokenizers").iterdir() if p.is_dir()]) == 1
    a, b = set(r0["rows"]), set(r1["rows"])
    assert not a & b and len(a) + len(b) > r0["n_rows"] - 4  # disjoint, covering up to a batch
    assert r0["eval_batches"] == r1["eval_batches"]
    assert r0["sharded_ok"] and r1["sharded_ok"]
    assert r0["metric"] == r1["metric"]  # all-reduced
    assert r0["metric"]["exact_match"] == pytest.approx(r0["expected"])
    assert r0["forwards"] == r1["forwards"] == 6
