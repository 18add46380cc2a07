"""paged_decode_attention(qknorm=...): the decode step's QK-norm + RoPE + KV write done by the decode
attention's partition programs (each normalizes and rotates its q heads, the one holding the
query's own position writes k and v first) gives the two launches' bits (qknorm_rope_kvwrite, then
paged_decode_attention): the attention output and both pools, every layout, bf16 and fp8 caches,
one partition or several."""

from __future__ import annotations

import random

import pytest
import torch
from qruntime.kernels.paged_decode_attention import paged_decode_attention
from qruntime.kernels.qknorm_rope_kvwrite import DeferredQKNorm
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS

BF = torch.bfloat16


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8 if x.element_size() == 1 else torch.int16)


def _case(layout: str, kv_dtype: str, nh: int, kvh: int, d: int, lens: list[int], block_size: int = 16):
    """Two identical caches of random contents, a qkv row per sequence, block tables with distinct
    scattered blocks, each sequence's slot at its last position (one padding row: context 0, slot -1)."""
    blocks_per_seq = -(-max(lens) // block_size)
    num_blocks = blocks_per_seq * len(lens) + 1
    spec = KVCacheSpec(KV_LAYOUTS[layout], kv_dtype, block_size, 1, kvh, d)
    caches = [KVCache(spec, num_blocks, BF, torch.device("cpu")) for _ in range(2)]
    for pools in (caches[0].k, caches[0].v):
        pools[0] = (torch.randn(pools[0].shape) * 2).to(pools[0].dtype)
    caches[1].k, caches[1].v = [caches[0].k[0].clone()], [caches[0].v[0].clone()]
    order = torch.randperm(num_blocks - 1)[: blocks_per_seq * len(lens)] + 1
    tables = order.view(len(lens), blocks_per_seq).to(torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    positions = (ctx.long() - 1).clamp(min=0)
    slots = torch.tensor(
        [
            int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size if n else -1
            for b, n in enumerate(lens)
        ]
    )
    qkv = (torch.randn(len(lens), (nh + 2 * kvh) * d) * 3).to(BF)
    weights = [(torch.randn(d) * 0.5 + 1).to(BF) for _ in range(2)]
    scales = (random.uniform(0.01, 0.05), random.uniform(0.01, 0.05)) if kv_dtype == "fp8_e4m3" else (1.0, 1.0)
    return caches, tables, ctx, positions, slots, qkv, weights, scales


@pytest.mark.parametrize(
    ("layout", "kv_dtype", "nh", "kvh", "d", "splits"),
    [
        ("nhd", "bf16", 4, 2, 64, 1),
        ("nhd", "bf16", 8, 2, 32, 3),
        ("hnd", "fp8_e4m3", 4, 1, 64, 2),
        ("x-packed", "bf16", 2, 2, 32, 2),
    ],
)
def test_the_decode_attention_does_the_qk_norm_to_the_two_launches_bits(layout, kv_dtype, nh, kvh, d, splits):
    lens = [random.randint(1, 70), random.randint(20, 90), 0, random.randint(1, 15)]
    print("context lengths", lens)
    caches, tables, ctx, positions, slots, qkv, (qw, kw), (k_scale, v_scale) = _case(layout, kv_dtype, nh, kvh, d, lens)
    outs = []
    for fused, cache in zip((False, True), caches, strict=True):
        deferred = DeferredQKNorm(
            qkv, qw, kw, positions, slots, cache.k[0], cache.v[0], nh, kvh, d, 1e-6, 1e6, KV_LAYOUTS[layout], 16,
            k_scale, v_scale,
        )  # fmt: skip
        q = None if fused else deferred.launch()
        outs.append(
            paged_decode_attention(
                q,
                cache.k[0],
                cache.v[0],
                tables,
                ctx,
                layout=layout,
                block_size=16,
                scale=d**-0.5,
                k_scale=k_scale,
                v_scale=v_scale,
                num_kv_heads=kvh,
                num_splits=splits,
                qknorm=deferred if fused else None,
            )  # fmt: skip
        )
    assert torch.equal(_bits(outs[0]), _bits(outs[1]))
    assert outs[0][2].abs().sum() == 0 and outs[0].abs().sum() > 0  # the padding row stays zero, the others not
    for name in ("k", "v"):
        assert torch.equal(_bits(getattr(caches[0], name)[0]), _bits(getattr(caches[1], name)[0])), name


def test_qknorm_is_refused_beside_a_q_or_other_pools():
    caches, tables, ctx, positions, slots, qkv, (qw, kw), _ = _case("nhd", "bf16", 2, 1, 32, [5, 9])
    deferred = DeferredQKNorm(
        qkv,
        qw,
        kw,
        positions,
        slots,
        caches[0].k[0],
        caches[0].v[0],
        2,
        1,
        32,
        1e-6,
        1e6,
        KV_LAYOUTS["nhd"],
        16,
        1.0,
        1.0,
    )
    kwargs = dict(layout="nhd", block_size=16, scale=0.2, k_scale=1.0, v_scale=1.0, num_kv_heads=1, qknorm=deferred)
    with pytest.raises(ValueError, match="qknorm stands for q"):
        paged_decode_attention(deferred.q_view(), caches[0].k[0], caches[0].v[0], tables, ctx, **kwargs)
    with pytest.raises(ValueError, match="pools this attention reads"):
        paged_decode_attention(None, caches[1].k[0], caches[1].v[0], tables, ctx, **kwargs)
