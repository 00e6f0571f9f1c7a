"""Random init: the same weights for any world size, drawn shard by shard."""
from __future__ import annotations

import torch

from llama_fsdp.model.llama import INIT_BLOCK_NUMEL, _normal_rows, build_meta_model, init_weights
from tests.conftest import make_spec


def test_any_split_of_the_rows_draws_the_same_values():
    shape = (1000, 3000)  # 349 rows per block: splits fall inside blocks
    full = _normal_rows(shape, 0, shape[0], seed=7, index=3)
    assert full.shape == shape and abs(float(full.std()) - 1) < 0.01
    for world in (2, 3, 4, 8):
        size = -(-shape[0] // world)  # torch.chunk's split, as FSDP2 shards dim 0
        parts = [_normal_rows(shape, r * size, max(0, min(size, shape[0] - r * size)), seed=7,
                              index=3) for r in range(world)]
        assert torch.equal(torch.cat(parts), full), world
    assert not torch.equal(_normal_rows(shape, 0, 10, seed=7, index=4), full[:10])  # per param
    assert not torch.equal(_normal_rows(shape, 0, 10, seed=8, index=3), full[:10])  # per seed
    assert INIT_BLOCK_NUMEL // 3000 == 349


def test_init_is_deterministic_and_scaled():
    spec = make_spec()
    a, b = build_meta_model(spec.model), build_meta_model(spec.model)
    for m in (a, b):
        m.to_empty(device="cpu")
        init_weights(m, std=0.02, seed=spec.train.seed)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    params = dict(a.named_parameters())
    assert torch.equal(params["model.norm.weight"], torch.ones_like(params["model.norm.weight"]))
    q = params["model.layers.0.self_attn.q_proj.weight"]
    o = params["model.layers.0.self_attn.o_proj.weight"]
    assert abs(float(q.detach().std()) - 0.02) < 0.002
    layers = spec.model.num_layers
    assert abs(float(o.detach().std()) - 0.02 / (2 * layers) ** 0.5) < 0.001  # residual scaling


def test_the_values_are_torch_randn_per_block_for_any_thread_count():
    """Blocks are drawn on several threads at once (8B's init took 55 s one block at a time on
    the H200 host): each block is still torch.randn from its own seeded generator, so the
    weights a seed gives do not change with the thread count, nor from before the threads."""
    shape, seed, index = (1000, 3000), 7, 3
    per_block = INIT_BLOCK_NUMEL // shape[1]
    threads = torch.get_num_threads()
    try:
        draws = []
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            draws.append(_normal_rows(shape, 0, shape[0], seed=seed, index=index))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(d, draws[0]) for d in draws[1:])
    # each block's generator seed, written out for (seed 7, parameter 3): the seeds every
    # checkpoint and run so far drew its init from, (7 x 1,000,003 + 3) x 1,000,033 + block;
    # a change of the seeding changes every run's weights, and must be made here as well
    seeds = {0: 7_000_255_000_792, 2: 7_000_255_000_794}
    for block, block_seed in seeds.items():
        gen = torch.Generator().manual_seed(block_seed)
        rows = min(per_block, shape[0] - block * per_block)
        expected = torch.randn((rows, shape[1]), generator=gen)
        assert torch.equal(draws[0][block * per_block:block * per_block + rows], expected)


def test_a_later_shards_rows_are_a_tensor_of_their_own():
    """init_rows for rank > 0 (rows starting inside a block) is a tensor of its own, not a view
    into the drawn blocks: an NF4 base is quantized from it, and torchao's NF4Tensor refuses an
    as_strided with another storage offset (a QLoRA run's rank 1 failed so in CI once)."""
    from llama_fsdp.model.llama import init_rows

    shape = (1000, 3000)
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        t = init_rows(name, shape, 500, 250, index=9, std=0.02, seed=1, n_layers=4)
        assert t.shape == (250, 3000) and t.storage_offset() == 0 and t.is_contiguous(), name
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name
