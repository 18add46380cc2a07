"""Launches folded into the kernel that reads their output (kernels/deferred_sum.py): a split-K GEMM's
reduction (fp8_gemm.SplitKPartials) into add_rmsnorm[_quant], silu_mul_quant and qknorm_rope_kvwrite,
and a fused MoE's combine (moe_combine.PairRows) into add_rmsnorm[_quant]. Given the slices, each
must write the bits it writes given the added-up output (split-K partials summed in split order
from zero, times xs then ws, rounded to nearest even, made here in torch; the MoE rows by the
combine kernel). Interpreter on CPU, native on a GPU."""

from __future__ import annotations

import pytest
import torch
from qruntime.kernels.add_rmsnorm_quant import add_rmsnorm, add_rmsnorm_quant
from qruntime.kernels.fp8_gemm import GemmConfig, SplitKPartials, ptpc_fp8_gemm
from qruntime.kernels.moe_combine import PairRows, moe_combine
from qruntime.kernels.qknorm_rope_kvwrite import qknorm_rope_kvwrite
from qruntime.kernels.silu_mul_quant import silu_mul_quant
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS
from test_kernel_fp8_gemm import operands

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16


def _partials(m: int, n: int, k: int, split: int) -> tuple[SplitKPartials, torch.Tensor]:
    """The deferred output of a fresh random split-K GEMM, and that output reduced in torch."""
    xq, xs, w, ws = operands(m, n, k)
    # weights that cancel: some outputs near zero, some negative zeros among the partials
    w[:, : k // 2] = w[:, k // 2 :]
    w[0] = 0.0
    out = ptpc_fp8_gemm(xq, xs, w, ws, BF16, GemmConfig(16, 32, 64, split, 4, 2), defer_reduce=True)
    assert isinstance(out, SplitKPartials) and out.split == split and out.shape == (m, n)
    acc = torch.zeros(m, n, dtype=torch.float32, device=DEVICE)
    for part in out.partials:
        acc = acc + part
    return out, (acc * xs * ws.float().T).to(BF16)


def _equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    bits = (lambda t: t.view(torch.uint8 if t.element_size() == 1 else torch.int16)) if a.is_floating_point() else None
    assert torch.equal(bits(a), bits(b)) if bits else torch.equal(a, b), f"{what} differs"


def test_no_split_returns_the_output_and_a_split_defers_only_when_asked():
    xq, xs, w, ws = operands(2, 64, 256)
    whole = ptpc_fp8_gemm(xq, xs, w, ws, BF16, GemmConfig(16, 32, 64, 1, 4, 2), defer_reduce=True)
    assert isinstance(whole, torch.Tensor)
    split = ptpc_fp8_gemm(xq, xs, w, ws, BF16, GemmConfig(16, 32, 64, 4, 4, 2))
    assert isinstance(split, torch.Tensor)
    deferred = ptpc_fp8_gemm(xq, xs, w, ws, BF16, GemmConfig(16, 32, 64, 4, 4, 2), defer_reduce=True)
    _equal(deferred.reduce(), split, "reduce() against the reduction launch")
    acc = torch.zeros_like(deferred.partials[0])
    for part in deferred.partials:
        acc = acc + part
    _equal(split, (acc * xs * ws.float().T).to(BF16), "the reduction launch against torch's")


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("quant", [True, False])
def test_add_rmsnorm_reads_the_partials(split, quant):
    m, hidden = 3, 320  # a row tile of 512 with masked columns
    x, reduced = _partials(m, hidden, 512, split)
    residual = (torch.randn(m, hidden, device=DEVICE) * 3).to(BF16)
    w = (torch.randn(hidden, device=DEVICE) * 0.5 + 1).to(BF16)
    kernel = add_rmsnorm_quant if quant else add_rmsnorm
    ours, ref = kernel(x, residual, w, 1e-6), kernel(reduced, residual, w, 1e-6)
    for a, b, what in zip(ours, ref, ("y", "ys", "residual_out") if quant else ("y", "residual_out"), strict=True):
        _equal(a, b, what)


def test_add_rmsnorm_reduces_first_where_it_cannot_read_the_partials():
    x, _ = _partials(2, 256, 256, 2)
    w = torch.ones(256, device=DEVICE, dtype=BF16)
    residual = torch.randn(2, 256, device=DEVICE).to(BF16)
    reduced = x.reduce()
    for args, kw in (((None, w, 1e-6), {}), ((residual, w, 1e-6), {"max_block": 64})):  # no residual; chunked rows
        for a, b in zip(add_rmsnorm_quant(x, *args, **kw), add_rmsnorm_quant(reduced, *args, **kw), strict=True):
            _equal(a, b, "reduced first")
    with pytest.raises(ValueError, match="deferred output"):
        add_rmsnorm_quant(x, residual[:1], w, 1e-6)


@pytest.mark.parametrize("split", [2, 3])
def test_silu_mul_quant_reads_the_partials(split):
    gate_up, reduced = _partials(4, 2 * 96, 384, split)
    for a, b, what in zip(silu_mul_quant(gate_up), silu_mul_quant(reduced), ("yq", "ys"), strict=True):
        _equal(a, b, what)


@pytest.mark.parametrize("layout", ["nhd", "x-packed"])
def test_qknorm_rope_kvwrite_reads_the_partials(layout):
    nh, kvh, d, block_size, t = 4, 2, 64, 16, 3
    qkv, reduced = _partials(t, (nh + 2 * kvh) * d, 256, 2)
    spec = KVCacheSpec(KV_LAYOUTS[layout], "bf16", block_size, 1, kvh, d)
    caches = [KVCache(spec, 4, BF16, torch.device(DEVICE)) for _ in range(2)]
    for cache in caches:
        cache.k[0].fill_(0.5)
        cache.v[0].fill_(-0.25)
    qw, kw = ((torch.randn(d, device=DEVICE) * 0.5 + 1).to(BF16) for _ in range(2))
    positions = torch.randint(0, 4096, (t,), device=DEVICE)
    slots = torch.randperm(4 * block_size, device=DEVICE)[:t]
    kw_args = dict(num_heads=nh, num_kv_heads=kvh, head_dim=d, eps=1e-6, theta=1e6, layout=KV_LAYOUTS[layout])
    kw_args |= dict(block_size=block_size, k_scale=1.0, v_scale=1.0)
    qs = [
        qknorm_rope_kvwrite(src, qw, kw, positions, slots, cache.k[0], cache.v[0], **kw_args)
        for src, cache in zip((qkv, reduced), caches, strict=True)
    ]
    _equal(qs[0], qs[1], "q")
    _equal(caches[0].k[0], caches[1].k[0], "k pool")
    _equal(caches[0].v[0], caches[1].v[0], "v pool")


@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("quant", [True, False])
def test_add_rmsnorm_adds_a_moe_tokens_expert_rows(top_k, quant):
    tokens, hidden = 3, 320
    # weighted expert rows of mixed magnitudes and signs: their fp32 sum rounds once
    out_pairs = (
        torch.randn(tokens * top_k, hidden, device=DEVICE) * torch.rand(tokens * top_k, 1, device=DEVICE) * 8
    ).to(BF16)
    rows = PairRows(out_pairs, top_k)
    assert rows.shape == (tokens, hidden)
    residual = (torch.randn(tokens, hidden, device=DEVICE) * 3).to(BF16)
    w = (torch.randn(hidden, device=DEVICE) * 0.5 + 1).to(BF16)
    kernel = add_rmsnorm_quant if quant else add_rmsnorm
    combined = moe_combine(out_pairs, top_k)
    _equal(rows.reduce(), combined, "reduce()")
    ours, ref = kernel(rows, residual, w, 1e-6), kernel(combined, residual, w, 1e-6)
    for a, b, what in zip(ours, ref, ("y", "ys", "residual_out") if quant else ("y", "residual_out"), strict=True):
        _equal(a, b, what)
