"""The kernels' one-formula addressing of a KV pool agrees with where KVCache.write puts each element,
for every layout and KV dtype."""

from __future__ import annotations

import random

import pytest
import torch
from qruntime.kernels.kv_addressing import pool_addressing
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS


@pytest.mark.parametrize("layout", list(KV_LAYOUTS))
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_formula_finds_what_the_cache_wrote(layout, kv_dtype):
    spec = KVCacheSpec(KV_LAYOUTS[layout], kv_dtype, 16, 1, 3, 32)
    cache = KVCache(spec, 5, torch.float32, torch.device("cpu"))
    k_pool, v_pool = cache.k[0], cache.v[0]
    k_addr = pool_addressing(spec.layout.k_dims, tuple(k_pool.shape), k_pool.stride(), 16, 32)
    v_addr = pool_addressing(spec.layout.v_dims, tuple(v_pool.shape), v_pool.stride(), 16, 32)
    slots = torch.randperm(80)[:20]
    k, v = torch.randn(20, 3, 32), torch.randn(20, 3, 32)
    cache.write(0, k, v, slots, 1.0, 1.0)
    flat_k, flat_v = k_pool.flatten().float(), v_pool.flatten().float()
    for _ in range(200):
        t = random.randrange(20)
        block, offset = divmod(int(slots[t]), 16)
        h, i = random.randrange(3), random.randrange(32)
        assert flat_k[k_addr.offset(block, h, offset, i)] == k[t, h, i].to(k_pool.dtype).float()
        assert flat_v[v_addr.offset(block, h, offset, i)] == v[t, h, i].to(v_pool.dtype).float()
