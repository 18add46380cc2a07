"""The fused QK-norm + RoPE + KV-write kernel with Qwen3-VL's interleaved M-RoPE (mrope_section,
positions [3, T]) against the reference op QKNormRoPEKVWrite given the same attribute.

Same bounds as test_kernel_qknorm_rope (whose helpers this reuses): q and k within one ulp plus what
one bf16 ulp of the normalized values moves a rotated output, at most 2 % of values differ, v and
untouched slots bit for bit. The three rows of positions differ (random), so a frequency reading
the wrong row moves its angle by far more than the bound; positions are a non-contiguous view.
With equal rows the kernel must write exactly the bits of plain RoPE (positions [T])."""

from __future__ import annotations

import pytest
import torch
from qruntime.kernels.qknorm_rope_kvwrite import qknorm_rope_kvwrite
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS
from qruntime.ops.attention import QKNormRoPEKVWrite
from qruntime.ops.base import OpEnv, StepContext
from test_kernel_qknorm_rope import _bits, _check_close, _check_untouched, _rope_slack, _run_kernel, _setup
from test_kernel_splitk_fold import _partials

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _mrope_positions(t: int) -> torch.Tensor:
    """Random int64 positions [3, T], the rows all different, as a non-contiguous view (strides (1, 4))."""
    store = torch.randint(0, 40960, (t, 4))
    positions = store[:, 1:].T
    assert positions.shape == (3, t) and positions.stride() == (1, 4)
    assert not torch.equal(positions[0], positions[1]) and not torch.equal(positions[1], positions[2])
    return positions


CASES = [  # (nh, kvh, d, mrope_section, T, heads per program: None = the wrapper's choice)
    (6, 2, 128, (24, 20, 20), 7, None),  # GQA 3, Qwen3-VL's section
    (4, 2, 64, (8, 12, 12), 5, None),
    (8, 2, 64, (16, 8, 8), 11, 2),  # heads grouped: the token's angles shared by 2 heads
    (4, 4, 64, (32, 0, 0), 1, None),  # a zero section: every frequency reads row 0
    (2, 1, 64, (10, 12, 10), 3, None),  # s_h != s_w
]


# every case in bf16 on both layout families (per-head rows, x-packed K); fp16 on two of them
RUNS = [("nhd", torch.bfloat16, c) for c in CASES] + [("x-packed", torch.bfloat16, c) for c in CASES]
RUNS += [("hnd", torch.float16, CASES[0]), ("nhd", torch.float16, CASES[2])]


@pytest.mark.parametrize(
    "layout, dtype, case",
    RUNS,
    ids=lambda v: "nh{}-kvh{}-d{}-s{}-T{}-heads{}".format(*v) if isinstance(v, tuple) else str(v),
)
def test_mrope_kernel_equals_reference_op(rng, layout, dtype, case):
    torch.manual_seed(rng.randrange(1 << 30))
    nh, kvh, d, section, t, heads = case
    spec, (cache_ref, cache_k), qkv, qw, kw, _, slots, attrs = _setup(layout, "bf16", nh, kvh, d, 16, t)
    attrs |= {"mrope_section": list(section)}  # as onnx hands an INTS attribute over
    if dtype == torch.float16:
        for cache in (cache_ref, cache_k):
            cache.k, cache.v = [p.half() for p in cache.k], [p.half() for p in cache.v]
        qkv, qw, kw = qkv.half(), qw.half(), kw.half()
    positions = _mrope_positions(t)
    before = (cache_ref.k[1].clone(), cache_ref.v[1].clone())
    op = QKNormRoPEKVWrite(attrs, OpEnv(dtype, torch.device("cpu"), spec))
    q_ref, _ = op(StepContext(cache_ref, None), qkv, qw, kw, positions, slots)
    q = _run_kernel(cache_k, qkv, qw, kw, positions, slots, attrs, heads_per_program=heads, mrope_section=section)

    assert q.shape == (t, nh, d) and q.dtype == dtype
    shrink = 1 if dtype == torch.bfloat16 else 8  # fp16 has 3 more mantissa bits
    _check_close(q, q_ref, dtype, _rope_slack(qkv[:, : nh * d].float(), qw.float(), nh, d) / shrink, "q")
    _check_untouched(cache_k, cache_ref, before, slots, 7)
    (k, v), (k_ref, v_ref) = cache_k.gather(1, slots, 1.0, 1.0), cache_ref.gather(1, slots, 1.0, 1.0)
    assert torch.equal(v, v_ref)
    slack = _rope_slack(qkv[:, nh * d : (nh + kvh) * d].float(), kw.float(), kvh, d) / shrink
    _check_close(k, k_ref, dtype, slack, "k")


@pytest.mark.parametrize("d, section", [(128, (24, 20, 20)), (64, (8, 12, 12))])
def test_equal_rows_are_plain_rope_bit_for_bit(rng, d, section):
    torch.manual_seed(rng.randrange(1 << 30))
    nh, kvh, t = 4, 2, 6
    spec, (cache_plain, cache_m), qkv, qw, kw, positions, slots, attrs = _setup("hnd", "fp8_e4m3", nh, kvh, d, 16, t)
    q_plain = _run_kernel(cache_plain, qkv, qw, kw, positions, slots, attrs)
    q_m = _run_kernel(cache_m, qkv, qw, kw, positions.expand(3, t), slots, attrs, mrope_section=section)
    assert torch.equal(_bits(q_m), _bits(q_plain))
    assert torch.equal(_bits(cache_m.k[1]), _bits(cache_plain.k[1]))
    assert torch.equal(_bits(cache_m.v[1]), _bits(cache_plain.v[1]))


def test_mrope_kernel_reads_split_k_partials():
    """The split-K qkv GEMM's partials folded into the M-RoPE kernel write what the reduced qkv writes."""
    nh, kvh, d, block_size, t = 4, 2, 64, 16, 3
    qkv, reduced = _partials(t, (nh + 2 * kvh) * d, 256, 2)
    spec = KVCacheSpec(KV_LAYOUTS["nhd"], "bf16", block_size, 1, kvh, d)
    caches = [KVCache(spec, 4, torch.bfloat16, DEVICE) for _ in range(2)]
    for cache in caches:
        cache.k[0].fill_(0.5)
        cache.v[0].fill_(-0.25)
    qw, kw = ((torch.randn(d, device=DEVICE) * 0.5 + 1).to(torch.bfloat16) for _ in range(2))
    positions = _mrope_positions(t).to(DEVICE)
    slots = torch.randperm(4 * block_size, device=DEVICE)[:t]
    kw_args = dict(num_heads=nh, num_kv_heads=kvh, head_dim=d, eps=1e-6, theta=1e6, layout=KV_LAYOUTS["nhd"])
    kw_args |= dict(block_size=block_size, k_scale=1.0, v_scale=1.0, mrope_section=(16, 8, 8))
    qs = [
        qknorm_rope_kvwrite(src, qw, kw, positions, slots, cache.k[0], cache.v[0], **kw_args)
        for src, cache in zip((qkv, reduced), caches, strict=True)
    ]
    assert torch.equal(_bits(qs[0]), _bits(qs[1]))
    assert torch.equal(_bits(caches[0].k[0]), _bits(caches[1].k[0]))
    assert torch.equal(_bits(caches[0].v[0]), _bits(caches[1].v[0]))


def test_mrope_rejects_bad_positions_and_sections(rng):
    torch.manual_seed(rng.randrange(1 << 30))
    nh, kvh, d, t = 2, 1, 64, 3
    _, (_, cache), qkv, qw, kw, positions, slots, attrs = _setup("nhd", "bf16", nh, kvh, d, 16, t)
    with pytest.raises(ValueError, match=r"positions must be an int64/int32 \[3, 3\]"):
        _run_kernel(cache, qkv, qw, kw, positions, slots, attrs, mrope_section=(16, 8, 8))
    with pytest.raises(ValueError, match=r"positions must be an int64/int32 \[3\]"):
        _run_kernel(cache, qkv, qw, kw, positions.expand(3, t), slots, attrs)
    for bad in ((16, 8, 9), (16, 8), (34, -1, -1), (16.0, 8, 8)):
        with pytest.raises(ValueError, match="mrope_section must be 3 non-negative integers summing to 32"):
            _run_kernel(cache, qkv, qw, kw, positions.expand(3, t), slots, attrs, mrope_section=bad)


def test_fast_op_passes_the_section_on(rng):
    """The fast path's op (ops/triton_ops.py) launches the M-RoPE kernel: its q equals the kernel's."""
    from qruntime.ops import triton_ops

    torch.manual_seed(rng.randrange(1 << 30))
    nh, kvh, d, t, section = 4, 2, 64, 5, (16, 8, 8)
    spec, (cache_op, cache_k), qkv, qw, kw, _, slots, attrs = _setup("nhd", "bf16", nh, kvh, d, 16, t)
    positions = _mrope_positions(t)
    for cache in (cache_op, cache_k):
        cache.k, cache.v = [p.to(DEVICE) for p in cache.k], [p.to(DEVICE) for p in cache.v]
    op = triton_ops.QKNormRoPEKVWrite(attrs | {"mrope_section": list(section)}, OpEnv(torch.bfloat16, DEVICE, spec))
    args = (x.to(DEVICE) for x in (qkv, qw, kw, positions, slots))
    q_op, _ = op(StepContext(cache_op, None), *args)
    q = _run_kernel(cache_k, qkv, qw, kw, positions, slots, attrs, mrope_section=section)
    assert torch.equal(_bits(q_op.cpu()), _bits(q))
    plain = _run_kernel(cache_k, qkv, qw, kw, positions[0], slots, attrs)
    assert not torch.equal(_bits(plain), _bits(q))  # the section made a difference
