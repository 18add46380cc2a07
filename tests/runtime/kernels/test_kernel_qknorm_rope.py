"""The fused QK-norm + RoPE + KV-write kernel against the reference op QKNormRoPEKVWrite.

Both start from identical random pools. Untouched slots must stay bit for bit; v is stored exactly
as the reference stores it (bf16 copy or fp8 quantization: the kernel rounds to e4m3 itself, so
the interpreter's fp8 cast does not enter). q and k follow the reference's rounding step by step and
almost always agree bit for bit; the one step that differs is the fp32 sum of squares (another
summation order), which now and then moves the RMS factor by an fp32 ulp and flips one rounding of
the normalized bf16 value. So: at most 1 ulp (bf16, or one e4m3 step) off, except by what one
bf16 ulp of the normalized inputs can move a rotated output (which matters where RoPE cancels),
and at most 2 % of the values differ at all. Where there is a GPU the kernel runs natively and the
reference still on the CPU (its IEEE-rounded math is the one the kernel follows)."""

from __future__ import annotations

import random

import pytest
import torch
from qruntime.kernels.qknorm_rope_kvwrite import qknorm_rope_kvwrite
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS
from qruntime.ops import functional as fn
from qruntime.ops.attention import QKNormRoPEKVWrite
from qruntime.ops.base import OpEnv, StepContext

FP8 = torch.float8_e4m3fn
EPS, THETA = 1e-6, 1e6
# the kernel runs natively where there is a GPU; the reference always runs on the CPU
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8 if x.element_size() == 1 else torch.int16)


def _spacing(x: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """Distance to the next representable value of `fmt` (bf16/fp16/e4m3) above |x|."""
    info = torch.finfo(fmt)
    mant = {torch.bfloat16: 7, torch.float16: 10, FP8: 3}[fmt]
    exp = torch.floor(torch.log2(x.double().abs().clamp(min=info.smallest_normal)))
    return torch.exp2(exp - mant)


def _check_close(ours: torch.Tensor, ref: torch.Tensor, fmt: torch.dtype, slack: torch.Tensor, what: str) -> None:
    """ours within one `fmt` spacing of ref, plus slack; at most 2 % differ."""
    err = (ours.double() - ref.double()).abs()
    bound = _spacing(ref, fmt) + slack
    assert torch.all(err <= bound), f"{what}: max error {err.max()}, {(err > bound).sum()} values beyond the bound"
    assert (err > 0).double().mean() < 0.02, f"{what}: {(err > 0).sum()} of {err.numel()} differ"


def _rope_slack(x: torch.Tensor, w: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """How far one bf16 ulp of the normalized values can move the rotated output: 2^-7 (|y| + |y_partner|)."""
    y = fn.rms_norm(x.reshape(len(x), heads, d), w, EPS).double().abs()
    return (y + y.roll(d // 2, -1)) * 2**-7


def _setup(layout: str, kv_dtype: str, nh: int, kvh: int, d: int, block_size: int, t: int, num_blocks: int = 7):
    spec = KVCacheSpec(KV_LAYOUTS[layout], kv_dtype, block_size, 2, kvh, d)
    caches = [KVCache(spec, num_blocks, torch.bfloat16, torch.device("cpu")) for _ in range(2)]
    for pools in (caches[0].k, caches[0].v):  # random initial contents, identical in both caches
        for i, pool in enumerate(pools):
            pools[i] = (torch.randn(pool.shape) * 40).clamp(-448, 448).to(pool.dtype)
    caches[1].k = [p.clone() for p in caches[0].k]
    caches[1].v = [p.clone() for p in caches[0].v]
    qkv = torch.randn(t, (nh + 2 * kvh) * d) * torch.rand(t, 1) * 4
    qkv[:, -1] = 1000.0  # beyond 448 * v_scale: fp8 v saturates
    qw = torch.randn(d) * 0.5 + 1
    kw = torch.randn(d) * 0.5 + 1
    positions = torch.randint(0, 40960, (t,))
    slots = torch.randperm(num_blocks * block_size)[:t]  # distinct, scattered over blocks and offsets
    k_scale, v_scale = (random.uniform(0.004, 0.03), random.uniform(0.004, 0.03)) if kv_dtype == "fp8_e4m3" else (1, 1)
    attrs = {"layer": 1, "layout": layout, "block_size": block_size, "kv_dtype": kv_dtype}
    attrs |= {"k_scale": k_scale, "v_scale": v_scale, "num_heads": nh, "num_kv_heads": kvh, "head_dim": d}
    attrs |= {"epsilon": EPS, "theta": THETA}
    bf = torch.bfloat16
    return spec, caches, qkv.to(bf), qw.to(bf), kw.to(bf), positions, slots, attrs


def _run_kernel(cache: KVCache, qkv, qw, kw, positions, slots, attrs, **launch) -> torch.Tensor:
    """The kernel on DEVICE over (CPU) `cache`'s layer-`layer` pools, updated in place; q back on the CPU."""
    a, layer = attrs, attrs["layer"]
    k_pool, v_pool = cache.k[layer].to(DEVICE), cache.v[layer].to(DEVICE)
    qkv, qw, kw, positions, slots = (x.to(DEVICE) for x in (qkv, qw, kw, positions, slots))
    q = qknorm_rope_kvwrite(
        qkv, qw, kw, positions, slots, k_pool, v_pool,
        num_heads=a["num_heads"], num_kv_heads=a["num_kv_heads"], head_dim=a["head_dim"], eps=a["epsilon"],
        theta=a["theta"], layout=KV_LAYOUTS[a["layout"]], block_size=a["block_size"],
        k_scale=a["k_scale"], v_scale=a["v_scale"], **launch,
    )  # fmt: skip
    cache.k[layer].copy_(k_pool)
    cache.v[layer].copy_(v_pool)
    return q.cpu()


def _touched(spec: KVCacheSpec, num_blocks: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean masks (K pool, V pool layout) of the elements the reference write stores to."""
    marker = KVCache(spec, num_blocks, torch.bfloat16, torch.device("cpu"))
    ones = torch.ones(len(slots), spec.num_kv_heads, spec.head_dim, dtype=torch.bfloat16)
    marker.write(0, ones, ones, slots, 1.0, 1.0)
    return marker.k[0].float() != 0, marker.v[0].float() != 0


def _check_untouched(ours: KVCache, ref: KVCache, before: tuple[torch.Tensor, torch.Tensor], slots, num_blocks: int):
    """Outside the written slots, layer 1's pools are bit for bit what they were, and layer 0's are equal."""
    touched_k, touched_v = _touched(ours.spec, num_blocks, slots)
    assert touched_k.sum() == touched_v.sum() == len(slots) * ours.spec.num_kv_heads * ours.spec.head_dim
    for cache in (ours, ref):
        assert torch.equal(_bits(cache.k[1])[~touched_k], _bits(before[0])[~touched_k])
        assert torch.equal(_bits(cache.v[1])[~touched_v], _bits(before[1])[~touched_v])
    assert torch.equal(_bits(ours.k[0]), _bits(ref.k[0])) and torch.equal(_bits(ours.v[0]), _bits(ref.v[0]))


CASES = [  # (nh, kvh, d, block_size, T, heads per program: None = the wrapper's choice)
    (6, 3, 64, 16, 13, None),
    (6, 3, 64, 16, 1, None),
    (2, 1, 96, 16, 5, None),  # d / 2 = 48: a padded half tile
    (4, 2, 32, 32, 1, None),
    (4, 2, 128, 16, 1, None),
    (4, 2, 32, 16, 6, 2),  # 2 heads per program (what the wrapper picks for larger T)
    (8, 4, 64, 16, 5, 4),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "nh{}-kvh{}-d{}-bs{}-T{}-heads{}".format(*c))
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("layout", list(KV_LAYOUTS))
def test_kernel_equals_reference_op(layout, kv_dtype, case):
    nh, kvh, d, bs, t, heads = case
    spec, (cache_ref, cache_k), qkv, qw, kw, positions, slots, attrs = _setup(layout, kv_dtype, nh, kvh, d, bs, t)
    before = (cache_ref.k[1].clone(), cache_ref.v[1].clone())
    env = OpEnv(torch.bfloat16, torch.device("cpu"), spec)
    q_ref, _ = QKNormRoPEKVWrite(attrs, env)(StepContext(cache_ref, None), qkv, qw, kw, positions, slots)
    q = _run_kernel(cache_k, qkv, qw, kw, positions, slots, attrs, heads_per_program=heads)

    assert q.shape == (t, nh, d) and q.dtype == torch.bfloat16
    _check_close(q, q_ref, torch.bfloat16, _rope_slack(qkv[:, : nh * d], qw, nh, d), "q")
    _check_untouched(cache_k, cache_ref, before, slots, 7)
    # the written slots, dequantized with scale 1 (fp8 codes as values), [T, kvh, d]
    (k, v), (k_ref, v_ref) = cache_k.gather(1, slots, 1.0, 1.0), cache_ref.gather(1, slots, 1.0, 1.0)
    assert torch.equal(v, v_ref)
    fmt, k_scale = (FP8, attrs["k_scale"]) if kv_dtype == "fp8_e4m3" else (torch.bfloat16, 1.0)
    _check_close(k, k_ref, fmt, _rope_slack(qkv[:, nh * d : (nh + kvh) * d], kw, kvh, d) / k_scale, "k")
    if kv_dtype == "fp8_e4m3":  # the clamp is exercised (_setup puts a large value in the last v column)
        assert v_ref.abs().max() == 448


def test_strided_rows_and_negative_slots_and_fp16():
    """qkv rows with a larger stride (a column slice), fp16, and a padding row (slot -1) that writes nothing."""
    nh, kvh, d, bs, t = 4, 2, 64, 16, 5
    spec, (cache_ref, cache_k), qkv, qw, kw, positions, slots, attrs = _setup("x-packed", "bf16", nh, kvh, d, bs, t)
    for cache in (cache_ref, cache_k):
        cache.k, cache.v = [p.half() for p in cache.k], [p.half() for p in cache.v]
    wide = torch.randn(t, qkv.shape[1] + 40, dtype=torch.float16)
    wide[:, 8 : 8 + qkv.shape[1]] = qkv.half()
    qkv_dev = wide.to(DEVICE)[:, 8 : 8 + qkv.shape[1]]  # the kernel's input: strided rows on DEVICE too
    qkv, qw, kw = wide[:, 8 : 8 + qkv.shape[1]], qw.half(), kw.half()
    assert qkv_dev.stride(0) == qkv.shape[1] + 40
    env = OpEnv(torch.float16, torch.device("cpu"), spec)
    q_ref, _ = QKNormRoPEKVWrite(attrs, env)(StepContext(cache_ref, None), qkv[:-1], qw, kw, positions[:-1], slots[:-1])
    before_k, before_v = cache_k.k[1].clone(), cache_k.v[1].clone()
    slots = slots.clone()
    slots[-1] = -1
    q = _run_kernel(cache_k, qkv_dev, qw, kw, positions, slots, attrs)
    assert q.dtype == torch.float16
    _check_close(q[:-1], q_ref, torch.float16, _rope_slack(qkv[:-1, : nh * d].float(), qw.float(), nh, d) / 8, "q")
    _check_untouched(cache_k, cache_ref, (before_k, before_v), slots[:-1], 7)
    (k, v), (k_ref, v_ref) = cache_k.gather(1, slots[:-1], 1.0, 1.0), cache_ref.gather(1, slots[:-1], 1.0, 1.0)
    assert torch.equal(v, v_ref)
    _check_close(
        k, k_ref, torch.float16, _rope_slack(qkv[:-1, nh * d : (nh + kvh) * d].float(), kw.float(), kvh, d) / 8, "k"
    )


def test_rejects_mismatched_inputs():
    nh, kvh, d, bs, t = 2, 1, 32, 16, 3
    spec, (_, cache), qkv, qw, kw, positions, slots, attrs = _setup("hnd", "fp8_e4m3", nh, kvh, d, bs, t)
    with pytest.raises(ValueError, match="qkv must be"):
        _run_kernel(cache, qkv[:, :-d], qw, kw, positions, slots, attrs)
    with pytest.raises(ValueError, match="q_norm_w"):
        _run_kernel(cache, qkv, qw.float(), kw, positions, slots, attrs)
    with pytest.raises(ValueError, match="slot_mapping"):
        _run_kernel(cache, qkv, qw, kw, positions, slots[:-1], attrs)
    with pytest.raises(ValueError, match="do not match layout"):
        _run_kernel(cache, qkv, qw, kw, positions, slots, attrs | {"layout": "nhd"})
    with pytest.raises(ValueError, match="heads_per_program"):
        _run_kernel(cache, qkv, qw, kw, positions, slots, attrs, heads_per_program=2)  # 2 does not divide kvh 1
