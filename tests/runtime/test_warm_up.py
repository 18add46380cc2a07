"""The load-time warm-up steps: within the engine's limits, of every kind a served batch meets, and
harmless: run through the model they write the scratch block alone."""

from __future__ import annotations

import pytest
import qruntime
import torch
from qruntime.engine.warm_up import warm_up_steps


@pytest.mark.parametrize("limits", [(2048, 4096, 256), (512, 700, 64), (64, 80, 8), (16, 2048, 256), (2048, 4096, 3)])
def test_the_steps_fit_the_limits_and_cover_the_kinds(limits, rng):
    budget, max_model_len, max_num_seqs = limits
    block_size, scratch = rng.choice([1, 8, 16, 32]), rng.randrange(1, 1000)
    steps = warm_up_steps(block_size, scratch, budget, max_model_len, max_num_seqs)
    assert steps
    for step in steps:
        assert sum(c.num_tokens for c in step) <= budget and len(step) <= max_num_seqs
        for c in step:
            assert c.start + c.num_tokens <= max_model_len
            assert set(c.block_table) == {scratch} and len(c.block_table) * block_size >= c.start + c.num_tokens
    kinds = {(any(c.num_tokens == 1 for c in s), any(c.num_tokens > 1 for c in s)) for s in steps}
    assert (True, True) in kinds and (False, True) in kinds  # decodes beside prompts, and prompts alone
    # every prefill row tile (16, 32, 64, 128) with its longest chunk, alone and beside decodes
    for tile in (16, 32, 64, 128):
        if tile // 2 + 1 + 8 + 2 <= min(budget, max_model_len - 80):  # a probe of that tile fits the limits
            for beside_decodes in (False, True):
                assert any(
                    any(c.num_tokens == 1 for c in s) == beside_decodes
                    and tile // 2 < max(c.num_tokens for c in s) <= tile
                    for s in steps
                ), (tile, beside_decodes)
    # the most decodes a step can hold beside a prompt: the decode kernel's one-partition variant
    if budget >= 18 and max_num_seqs >= 2:
        most = min(max_num_seqs - 1, budget - 17)
        assert any(sum(c.num_tokens == 1 for c in s) == most and any(c.num_tokens > 1 for c in s) for s in steps)
    if budget >= 700 and max_model_len > 700:
        assert any(c.num_tokens > 512 and c.start == 0 for s in steps for c in s)  # fused attention's kind


def test_running_them_writes_the_scratch_block_alone(tiny_ckpt, compiled, rng):
    engine = qruntime.load(compiled(tiny_ckpt, "ptpc-fp8"), device="cpu", num_kv_blocks=67, max_model_len=1024)
    cache = engine.runner.kv_cache
    for pool in (*cache.k, *cache.v):
        pool.copy_(
            torch.randn(pool.shape, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))).to(pool.dtype)
        )
    before = [t.clone() for t in (*cache.k, *cache.v)]
    scratch = rng.randrange(67)
    steps = warm_up_steps(cache.spec.block_size, scratch, 1024, 1024, 64)
    for chunks in steps:
        logits = engine.runner.execute(chunks)
        assert logits.shape[0] == len(chunks) and torch.isfinite(logits.float()).all()
    layout_block_dim = [d for d, n in enumerate(cache.k[0].shape) if n == 67][0]
    changed = set()
    for old, new in zip(before, (*cache.k, *cache.v), strict=True):
        diff = (old != new).movedim(layout_block_dim, 0).reshape(67, -1).any(-1)
        changed |= set(diff.nonzero().flatten().tolist())
    assert changed == {scratch}
