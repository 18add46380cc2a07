"""The fused FP8 MoE kernels (routing + quant, align, up/SiLU, down, combine) and the fast-path MoE
op against the torch references of qruntime.ops (interpreter on CPU, native on a GPU).

Shapes are small and odd on purpose: E not a power of two, I and H not multiples of the tiles,
T not a multiple of BLOCK_M, single tokens, experts without tokens and all tokens on one expert.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moe_plans import reference_and_fast_plans
from qruntime.kernel_configs import KernelTable
from qruntime.kernels.fused_moe import (
    MoEConfig,
    TileConfig,
    config_from_dict,
    default_config,
    fused_moe,
    grouped_config,
    sweep_configs,
    table_key,
)
from qruntime.kernels.moe_align import expert_load, moe_align, padded_size
from qruntime.kernels.moe_combine import moe_combine
from qruntime.kernels.moe_gemm import PairBlocks, moe_down, moe_up_silu
from qruntime.kernels.moe_gemv import GemvTile, MoEGemvConfig, moe_down_one, moe_up_one
from qruntime.kernels.moe_routing import moe_route_quant, moe_route_quant_one, moe_router_one, router_one_programs
from qruntime.ops import functional as fn
from qruntime.ops import moe, triton_ops
from qruntime.ops.base import OpEnv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = MoEConfig(16, TileConfig(32, 32, 4, 2), TileConfig(32, 32, 4, 2))  # tails in I, H and K
SMALL_GEMV = MoEGemvConfig(GemvTile(16, 32, 2), GemvTile(8, 16, 1))  # one token: tails in I, H and K


def _quant_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 weights and bf16 scales, as the ptpc-fp8 scheme stores them."""
    scale = (w.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.to(torch.bfloat16)


def experts(num_experts: int, inter: int, hidden: int) -> tuple[torch.Tensor, ...]:
    """Fresh random PTPC experts on DEVICE: (w13 [E, 2I, H], w13_scale, w2 [E, H, I], w2_scale)."""
    w13, s13 = _quant_rows(torch.randn(num_experts, 2 * inter, hidden) * torch.rand(num_experts, 2 * inter, 1))
    w2, s2 = _quant_rows(torch.randn(num_experts, hidden, inter) * torch.rand(num_experts, hidden, 1))
    return tuple(t.to(DEVICE) for t in (w13, s13, w2, s2))


def routed_ids(tokens: int, num_experts: int, top_k: int, only: int | None = None) -> torch.Tensor:
    """[T, k] int32 distinct experts per token (random; or experts only, only+1, ... for all tokens)."""
    if only is not None:
        return torch.arange(only, only + top_k, dtype=torch.int32).repeat(tokens, 1).to(DEVICE)
    return torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)]).int().to(DEVICE)


def untied_router(x: torch.Tensor, num_experts: int, top_k: int, scale: float = 0.3) -> torch.Tensor:
    """Fresh random router rows [E, H] (x's dtype) under which every token's k-th largest logit
    beats the next by a margin. bf16 logits tie often, and at that boundary a tie picks another
    expert in the kernel (lowest id) than in torch.topk on CPU (unspecified), which moves the whole
    token's output; ties themselves are tested by test_route_ties_pick_the_lowest_expert_id."""
    for _ in range(200):
        router_w = (torch.randn(num_experts, x.shape[-1]) * scale).to(x.dtype)
        if top_k == num_experts:
            return router_w
        top = F.linear(x, router_w).float().topk(top_k + 1, -1).values
        if bool((top[:, top_k - 1] - top[:, top_k] > 0.1).all()):
            return router_w
    raise AssertionError(f"no router without near-ties for {tuple(x.shape)} tokens, E={num_experts}, k={top_k}")


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    _, e = torch.frexp(x.float().abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e - 8)


def rounding_misses(y: torch.Tensor, ref: torch.Tensor, ulps: int = 1, rel: float = 1e-6) -> float:
    """Fraction of elements further apart than fp32 summation order (rel of the largest |ref|) or,
    in bf16 / fp16, than `ulps` ulps (roundings that summation order or a last-bit exp flipped)."""
    assert y.shape == ref.shape and y.dtype == ref.dtype
    exact = ref.dtype == torch.float32
    y, ref = y.float().cpu(), ref.float().cpu()
    tol = rel * ref.abs().amax() if exact else ulps * bf16_ulp(torch.maximum(y.abs(), ref.abs()))
    return float(((y - ref).abs() > tol).float().mean())


def sqnr_db(ref: torch.Tensor, y: torch.Tensor) -> float:
    ref, y = ref.float().cpu(), y.float().cpu()
    noise = (ref - y).pow(2).mean().clamp(min=1e-30)
    return float(10 * torch.log10(ref.pow(2).mean() / noise))


def token_sqnr_db(ref: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sqnr_db of each token's row [T]."""
    ref, y = ref.float().cpu(), y.float().cpu()
    noise = (ref - y).pow(2).mean(-1).clamp(min=1e-30)
    return 10 * torch.log10(ref.pow(2).mean(-1) / noise)


# ---- routing + quantization of x ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k", "norm", "hidden", "max_block"),
    [(1, 8, 2, True, 64, 8192), (9, 6, 3, False, 100, 32), (5, 128, 8, True, 48, 8192), (4, 5, 1, True, 33, 8192)],
)
def test_route_quant_matches_moe_routing_and_dynamic_quant(tokens, num_experts, top_k, norm, hidden, max_block, dtype):
    logits = (torch.randn(tokens, num_experts) * 3).to(dtype)
    x = (torch.randn(tokens, hidden) * torch.logspace(-3, 3, tokens)[:, None]).to(dtype)
    weights, ids, xq, xs = moe_route_quant(logits.to(DEVICE), x.to(DEVICE), top_k, norm, max_block=max_block)
    ref_w, ref_ids = fn.moe_routing(logits.float(), top_k, norm)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    if dtype == torch.float32:  # random fp32 logits have no ties
        assert torch.equal(ids.cpu().long(), ref_ids)
    # bf16 logits over many experts do tie: equal probabilities come lowest id first (torch.topk on
    # CUDA's order; on CPU it varies), so the ids are the stable descending order of the probabilities
    stable = torch.sort(logits.float().softmax(-1), dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(ids.cpu().long(), stable)
    # tied slots hold equal weights; on a GPU Triton's exp is within a few fp32 ulps of torch's
    torch.testing.assert_close(weights.cpu(), ref_w, rtol=2e-6, atol=1e-9)
    ref_q, ref_s = fn.dynamic_quant(x, 0)
    assert torch.equal(xq.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(xs.cpu(), ref_s)


def test_route_ties_pick_the_lowest_expert_id():
    logits = torch.randint(-2, 3, (16, 12)).float()  # many exact ties
    weights, ids, _, _ = moe_route_quant(logits.to(DEVICE), torch.randn(16, 32, device=DEVICE), 4, False)
    probs = logits.softmax(-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True)  # equal values: lower index first
    assert torch.equal(ids.cpu().long(), order.indices[:, :4])
    torch.testing.assert_close(weights.cpu(), order.values[:, :4], rtol=2e-6, atol=0)


def test_route_quant_checks_its_inputs():
    x = torch.randn(3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="top_k must be in 1..4"):
        moe_route_quant(torch.randn(3, 4, device=DEVICE), x, 5, True)
    with pytest.raises(ValueError, match="disagree on T"):
        moe_route_quant(torch.randn(2, 4, device=DEVICE), x, 2, True)
    with pytest.raises(TypeError):
        moe_route_quant(torch.randn(3, 4, device=DEVICE), x.int(), 2, True)


# ---- align --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k", "block_m", "only"),
    [
        (1, 128, 8, 16, None),
        (7, 6, 2, 16, None),
        (37, 5, 1, 32, None),
        (300, 128, 8, 64, None),
        (19, 8, 1, 16, 3),
        (1100, 24, 8, 16, None),  # 8800 pairs: count and scatter over a grid (SPLIT_CHUNKS)
        (1030, 12, 8, 32, 2),
    ],
)
def test_align_groups_every_pair_once_by_expert(tokens, num_experts, top_k, block_m, only):
    ids = routed_ids(tokens, num_experts, top_k, only)
    sorted_ids, block_expert, num_padded, amax = moe_align(ids, num_experts, block_m)
    pairs = tokens * top_k
    assert sorted_ids.numel() == padded_size(pairs, num_experts, block_m) == block_expert.numel() * block_m
    counts = expert_load(ids, num_experts).cpu()
    assert counts.sum() == pairs
    padded = (counts + block_m - 1) // block_m * block_m
    assert int(num_padded.item()) == int(padded.sum()) <= sorted_ids.numel()
    flat, sorted_ids, block_expert = ids.cpu().reshape(-1), sorted_ids.cpu(), block_expert.cpu()
    start = 0
    for e in range(num_experts):
        segment = sorted_ids[start : start + padded[e]]
        real, pad = segment[: counts[e]], segment[counts[e] :]
        assert sorted(real.tolist()) == torch.where(flat == e)[0].tolist()  # each pair of e exactly once
        assert torch.all(pad == pairs)  # the sentinel
        assert torch.all(block_expert[start // block_m : (start + padded[e]) // block_m] == e)
        start += int(padded[e])
    assert torch.all(amax.cpu()[: sorted_ids.numel()] == 0)
    if only is not None:
        assert counts[only] == tokens and int((counts > 0).sum()) == top_k


@pytest.mark.parametrize(("num_experts", "top_k", "block_m"), [(128, 8, 16), (10, 3, 32), (6, 6, 16), (5, 1, 64)])
def test_one_token_is_laid_out_by_its_routing_launch(num_experts, top_k, block_m, monkeypatch):
    """Batch-1 decode: the routing launch also writes the pair list, a block per slot, and the
    fused MoE launches no align; the grouped GEMMs then give align's results bit for bit."""
    hidden, inter = 72, 40
    x = torch.randn(1, hidden, device=DEVICE).to(torch.bfloat16)
    logits = torch.randn(1, num_experts, device=DEVICE)
    (weights, ids, xq, xs), layout = moe_route_quant_one(logits, x, top_k, True, block_m)
    for got, want in zip((weights, ids, xq, xs), moe_route_quant(logits, x, top_k, True), strict=True):
        assert torch.equal(
            got.view(torch.uint8) if got.dtype == xq.dtype else got,
            want.view(torch.uint8) if want.dtype == xq.dtype else want,
        )
    sorted_ids, block_expert, num_padded, amax = (t.cpu() for t in layout)
    assert sorted_ids.numel() == padded_size(top_k, num_experts, block_m) == top_k * block_m
    assert block_expert.tolist() == ids.cpu()[0].tolist() and int(num_padded) == top_k * block_m
    firsts = torch.arange(top_k) * block_m
    assert sorted_ids[firsts].tolist() == list(range(top_k))
    rest = torch.ones(sorted_ids.numel(), dtype=torch.bool)
    rest[firsts] = False
    assert torch.all(sorted_ids[rest] == top_k) and torch.all(amax == 0)
    # the GEMMs over this list and over align's give the same bits (rows do not depend on position)
    w13, s13, w2, s2 = experts(num_experts, inter, hidden)
    outs = []
    for blocks in (PairBlocks(*layout, block_m, top_k, top_k), _blocks(ids, num_experts, block_m)):
        act = moe_up_silu(xq, xs, w13, s13, blocks, x.dtype, block_n=32, block_k=32, num_warps=4, num_stages=2)
        outs.append(
            moe_combine(
                moe_down(act, w2, s2, weights, blocks, block_n=32, block_k=32, num_warps=4, num_stages=2), top_k
            )
        )
    assert torch.equal(outs[0], outs[1])
    from qruntime.kernels import fused_moe as fused

    def no_align(*args, **kwargs):
        raise AssertionError("moe_align launched for one token")

    monkeypatch.setattr(fused, "moe_align", no_align)
    y = fused_moe(x, logits.to(x.dtype), w13, s13, w2, s2, top_k, True, SMALL)
    assert y.shape == (1, hidden) and torch.isfinite(y.float()).all()
    with pytest.raises(AssertionError, match="moe_align launched"):  # two tokens: align groups them
        fused_moe(x.repeat(2, 1), logits.to(x.dtype).repeat(2, 1), w13, s13, w2, s2, top_k, True, SMALL)
    with pytest.raises(ValueError, match="one token"):
        moe_route_quant_one(logits.repeat(2, 1), x.repeat(2, 1), top_k, True, block_m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("num_experts", "top_k", "hidden"), [(128, 8, 200), (10, 3, 72), (5, 1, 48), (40, 4, 64), (6, 2, 4500)]
)
def test_one_tokens_router_runs_in_its_routing_launch(num_experts, top_k, hidden, dtype):
    """moe_router_one: the router GEMV a program per router row, each quantizing its slice of x (H =
    4500: x read in two tiles), the last to finish routing and laying out: what F.linear +
    moe_route_quant_one give (the logits' sums in another order: the same experts, weights to fp32
    rounding; x's codes and scale bit for bit), for three routers in a row (its counter goes back to
    zero; a program that routed early would read the logits another router left in the scratch)."""
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    assert router_one_programs(num_experts, hidden)[1] == num_experts
    for _ in range(3):
        x = torch.randn(1, hidden).to(dtype)
        router_w = untied_router(x, num_experts, top_k)
        x, router_w = x.to(DEVICE), router_w.to(DEVICE)
        want, want_layout = moe_route_quant_one(F.linear(x, router_w), x, top_k, True, 16)
        (weights, ids, xq, xs), layout = moe_router_one(x, router_w, top_k, True, 16, counter)
        assert int(counter.item()) == 0
        # fp32 sums of H products in another order: a few ulps of the logits, amplified by exp
        assert torch.equal(ids, want[1]) and torch.allclose(
            weights, want[0], rtol=1e-5 if hidden <= 512 else 1e-4, atol=0
        )
        assert torch.equal(xq.view(torch.uint8), want[2].view(torch.uint8)) and torch.equal(xs, want[3])
        for got, expected in zip(layout, want_layout, strict=True):
            assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="router_w must be"):
        moe_router_one(x, router_w.T.contiguous(), top_k, True, 16, counter)
    with pytest.raises(ValueError, match="counter"):
        moe_router_one(x, router_w, top_k, True, 16, counter.long())


@pytest.mark.parametrize(("num_experts", "top_k", "hidden"), [(10, 3, 72), (6, 2, 9000)])
def test_one_tokens_routing_launch_can_normalize_its_row(num_experts, top_k, hidden):
    """moe_router_one(..., rms=(residual, w, residual_out, eps)): every program computes y =
    rms_norm(x + residual) itself (add_rmsnorm's arithmetic) and program 0 stores x + residual: the
    add_rmsnorm launch then moe_router_one of its y, bit for bit under the interpreter (H = 9000: the
    norm's and the router's tiles both chunked)."""
    from qruntime.kernels.add_rmsnorm_quant import add_rmsnorm

    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    x, residual = (torch.randn(1, hidden) * 2).bfloat16().to(DEVICE), torch.randn(1, hidden).bfloat16().to(DEVICE)
    norm_w = (torch.rand(hidden) + 0.5).bfloat16().to(DEVICE)
    y, want_ro = add_rmsnorm(x, residual, norm_w, 1e-6)
    router_w = untied_router(y.float().cpu(), num_experts, top_k).bfloat16().to(DEVICE)
    want, want_layout = moe_router_one(y, router_w, top_k, True, 16, counter)
    ro = torch.full_like(x, float("nan"))
    got, layout = moe_router_one(x, router_w, top_k, True, 16, counter, rms=(residual, norm_w, ro, 1e-6))
    assert int(counter.item()) == 0 and torch.equal(ro, want_ro)
    assert torch.equal(got[1], want[1])  # the experts (the router's margin covers a GPU's rounding)
    if DEVICE == "cpu":  # the rest bit for bit; on a GPU the sums of squares may round in another order
        for a, b in zip((*got, *layout), (*want, *want_layout), strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)
    with pytest.raises(ValueError, match="norm weight must be"):
        moe_router_one(x, router_w, top_k, True, 16, counter, rms=(residual, norm_w[:-1], ro, 1e-6))


def test_align_checks_its_inputs():
    with pytest.raises(ValueError, match="int32"):
        moe_align(torch.zeros(2, 2, dtype=torch.int64, device=DEVICE), 4, 16)
    with pytest.raises(ValueError, match="block_m"):
        moe_align(torch.zeros(2, 2, dtype=torch.int32, device=DEVICE), 4, 24)


# ---- grouped GEMMs ------------------------------------------------------------------------------


def _blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> PairBlocks:
    sorted_ids, block_expert, num_padded, amax = moe_align(ids, num_experts, block_m)
    return PairBlocks(sorted_ids, block_expert, num_padded, amax, block_m, ids.shape[1], ids.numel())


def _positions(blocks: PairBlocks) -> dict[int, int]:
    """pair id -> its list position."""
    used = blocks.sorted_ids.cpu()[: int(blocks.num_padded.item())]
    return {int(p): i for i, p in enumerate(used.tolist()) if p < blocks.num_pairs}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "inter", "hidden"), [(1, 8, 2, 48, 64), (21, 6, 3, 40, 72)])
def test_up_silu_matches_ptpc_linear_then_silu_mul(tokens, num_experts, top_k, inter, hidden, dtype):
    w13, s13, _, _ = experts(num_experts, inter, hidden)
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    xq, xs = fn.dynamic_quant(x, 0)
    ids = routed_ids(tokens, num_experts, top_k)
    blocks = _blocks(ids, num_experts, 16)
    act = moe_up_silu(xq, xs, w13, s13, blocks, dtype, block_n=32, block_k=32, num_warps=4, num_stages=2)
    assert act.dtype == dtype
    where = _positions(blocks)
    rows = torch.tensor([where[p] for p in range(tokens * top_k)])
    flat = ids.cpu().reshape(-1).long()
    ref = torch.stack(
        [
            fn.silu_mul(fn.ptpc_linear(xq[p // top_k][None], xs[p // top_k][None], w13[flat[p]], s13[flat[p]], dtype))[
                0
            ]
            for p in range(tokens * top_k)
        ]
    )
    got = act.cpu()[rows]
    # on a GPU Triton's exp may move sigmoid's last bit: act then differs by up to 2 ulps, rarely
    assert rounding_misses(got, ref, ulps=2, rel=4e-6) == 0 and rounding_misses(got, ref, ulps=0) <= 0.01
    # the row amax is exactly that of the stored act rows
    assert torch.equal(blocks.row_amax.cpu()[rows], got.float().abs().amax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "inter", "hidden"), [(1, 8, 2, 48, 64), (21, 6, 3, 72, 40)])
def test_down_quantizes_act_per_row_and_weights_the_pairs(tokens, num_experts, top_k, inter, hidden, dtype):
    _, _, w2, s2 = experts(num_experts, inter, hidden)
    ids = routed_ids(tokens, num_experts, top_k)
    blocks = _blocks(ids, num_experts, 16)
    rows = blocks.sorted_ids.numel()
    act = (torch.randn(rows, inter) * torch.logspace(-2, 2, rows)[torch.randperm(rows)][:, None]).to(dtype)
    blocks.row_amax.copy_(act.float().abs().amax(-1).to(DEVICE))
    topk_w = torch.rand(tokens, top_k, device=DEVICE)
    out = moe_down(act.to(DEVICE), w2, s2, topk_w, blocks, block_n=32, block_k=32, num_warps=4, num_stages=2)
    where = _positions(blocks)
    flat = ids.cpu().reshape(-1).long()
    ref = []
    for p in range(tokens * top_k):
        aq, as_ = fn.dynamic_quant(act[where[p]][None], 0)  # the reference's per-token quantization
        down = fn.ptpc_linear(aq, as_, w2[flat[p]].cpu(), s2[flat[p]].cpu(), dtype)
        ref.append((down * topk_w.cpu().reshape(-1)[p].to(dtype))[0])
    assert out.dtype == dtype and out.shape == (tokens * top_k, hidden)
    ref = torch.stack(ref)
    assert rounding_misses(out, ref) == 0 and rounding_misses(out, ref, ulps=0) <= 0.01


@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_combine_adds_the_slots_in_order(top_k):
    out_pairs = torch.randn(5 * top_k, 70, device=DEVICE).to(torch.bfloat16)
    out = moe_combine(out_pairs, top_k)
    acc = torch.zeros(5, 70)
    for s in range(top_k):
        acc = acc + out_pairs.cpu().view(5, top_k, 70)[:, s].float()
    assert torch.equal(out.cpu(), acc.to(torch.bfloat16))


# ---- the whole op -------------------------------------------------------------------------------


def _ops(num_experts: int, top_k: int, dtype: torch.dtype, kernels: KernelTable | None = None, **attrs):
    attrs = {"num_experts": num_experts, "top_k": top_k, "norm_topk_prob": True, "linear": "PTPCLinear"} | attrs
    attrs.setdefault("group_size", 0)
    ref = moe.MoE(attrs, OpEnv(dtype, torch.device("cpu"), None))
    fast = triton_ops.MoE(attrs, OpEnv(dtype, torch.device(DEVICE), None, kernels))
    return ref, fast


CASES = [  # tokens, E, k, I, H, norm, all tokens on one expert set
    (1, 8, 2, 48, 64, True, False),
    (1, 10, 3, 40, 48, False, False),  # one token: laid out by its routing launch, no align
    (27, 6, 3, 80, 72, False, False),  # T, I, H off the tiles; E not a power of two
    (20, 8, 8, 32, 64, True, False),  # k = E: every expert gets every token
    (23, 10, 1, 40, 48, True, False),  # k = 1: some experts get none
    (18, 7, 1, 48, 40, True, True),  # every token on one expert
]


@pytest.mark.parametrize("config", [SMALL, SMALL_GEMV], ids=["grouped", "gemv"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "inter", "hidden", "norm", "one_expert"), CASES)
def test_fused_moe_op_matches_the_reference_op(
    tokens, num_experts, top_k, inter, hidden, norm, one_expert, dtype, config
):
    """The op against the reference, on the grouped GEMMs and on the one-token GEMVs (a GEMV config
    at more than one token stands for the grouped GEMMs' default)."""
    w13, s13, w2, s2 = experts(num_experts, inter, hidden)
    if one_expert:  # x > 0 and router rows c_e * 1 with c_2 the largest: every token picks expert 2
        x = (torch.rand(tokens, hidden) + 0.1).to(dtype)
        router_w = (torch.ones(num_experts, hidden) * torch.randperm(num_experts).float()[:, None] * 0.01).to(dtype)
        router_w[2] = 0.2
    else:
        x = torch.randn(tokens, hidden).to(dtype)
        router_w = untied_router(x, num_experts, top_k)
    ref_op, fast_op = _ops(num_experts, top_k, dtype, norm_topk_prob=norm)
    assert fast_op.capturable and not ref_op.capturable
    fast_op.configs[tokens] = config  # small tiles: tails in I, H and K at these sizes
    weights = (w13.cpu(), s13.cpu(), w2.cpu(), s2.cpu())
    ref = ref_op(None, x, router_w, *weights)
    y = fast_op(None, x.to(DEVICE), router_w.to(DEVICE), w13, s13, w2, s2)
    assert y.dtype == dtype and y.shape == (tokens, hidden)
    if one_expert:
        assert torch.all(fn.moe_routing(F.linear(x, router_w), top_k, norm)[1] == 2)
    # bf16: the reference adds the k contributions in bf16, the kernel in fp32 (~2^-9 relative).
    # fp32: summation order only, except where it moves a value of act (SiLU(gate) * up) across an
    # fp8 rounding boundary: one code then differs by an fp8 step and that token's whole row by
    # ~60-70 dB (CI at a6c53dd saw 67.6 dB over all 27 rows). So every row must be > 40 dB (a wrong
    # expert, weight or scale is ~0 dB) and all but one > 100 dB.
    rows = token_sqnr_db(ref, y)
    assert bool((rows > 40).all()), rows
    if dtype == torch.float32:
        assert int((rows <= 100).sum()) <= 1, rows
    if top_k == 1:  # one contribution per token, no adds: the same roundings (on a GPU, an exp's
        # last bit may flip an fp8 rounding of act and so move a few outputs)
        assert rounding_misses(y, ref, ulps=0) <= 0.01
    if dtype == torch.bfloat16:  # deterministic, whatever order the atomics give the pairs
        assert torch.equal(fast_op(None, x.to(DEVICE), router_w.to(DEVICE), w13, s13, w2, s2), y)


def test_fused_moe_default_config_and_fp16():
    w13, s13, w2, s2 = experts(6, 40, 48)
    x = torch.randn(3, 48).half()
    router_w = untied_router(x, 6, 2, scale=1.0)
    ref = moe.MoE(
        {"num_experts": 6, "top_k": 2, "norm_topk_prob": True, "linear": "PTPCLinear", "group_size": 0},
        OpEnv(torch.float16, torch.device("cpu"), None),
    )(None, x, router_w, w13.cpu(), s13.cpu(), w2.cpu(), s2.cpu())
    x, router_w = x.to(DEVICE), router_w.to(DEVICE)
    y = fused_moe(x, F.linear(x, router_w), w13, s13, w2, s2, 2, True)
    assert y.dtype == torch.float16 and sqnr_db(ref, y) > 40


def test_fast_op_uses_the_tuned_config_and_falls_back_where_the_kernel_does_not_apply():
    w13, _, _, _ = experts(8, 48, 64)
    tuned = MoEConfig(32, TileConfig(16, 64, 2, 3), TileConfig(64, 32, 8, 5))
    key = table_key(8, 96, 64, 2)
    table = KernelTable.from_dict({"device": "GPU X", "entries": {key: {"4": tuned.to_dict() | {"us": 1.5}}}}, "t")
    _, fast = _ops(8, 2, torch.bfloat16, kernels=table)
    assert fast._config(3, w13) == tuned and fast._config(9, w13) == tuned  # bucket 4, the largest beyond
    _, untuned = _ops(8, 2, torch.bfloat16)
    assert untuned._config(3, w13) == default_config(3, 8, 48, 64, 2)
    for attrs in ({"group_size": 128}, {"group_size": -1}, {"linear": "Gemm"}, {"linear": "BlockFP8Linear"}):
        _, other = _ops(8, 2, torch.bfloat16, **attrs)
        assert other.kernel is None and not other.capturable


def test_fast_op_is_in_the_triton_op_table():
    from qruntime.ops import registry

    assert registry.triton_ops()[(registry.QCOMPILE_DOMAIN, "MoE")] is triton_ops.MoE
    assert registry.reference_ops()[(registry.QCOMPILE_DOMAIN, "MoE")] is moe.MoE


def test_a_moe_graph_plans_capturable_on_the_fast_path(tiny_moe_ckpt, compiled, rng):
    """tiny-moe (ptpc-fp8) bound to the fast op table: its MoE nodes run the kernel, so nothing in
    the plan keeps it out of CUDA graphs; a MoE node on the artifact's weights matches the reference
    on every token whose experts are not a near-tie (the two paths round the router's scores
    differently, so a token whose k-th and next expert score within rounding may pick either: about
    one input in 60 had one, and the whole-output SQNR fell to 12-14 dB)."""
    artifact = compiled(tiny_moe_ckpt, "ptpc-fp8")
    weights, ref_plan, fast_plan, moe_nodes = reference_and_fast_plans(artifact, DEVICE)
    assert not ref_plan.capturable and fast_plan.capturable
    assert len(moe_nodes) == 2 and all(type(f.op) is triton_ops.MoE for _, f in moe_nodes)
    ref_node, fast_node = moe_nodes[0]
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    x = torch.randn(48, 64, generator=generator).to(DEVICE, torch.bfloat16)
    args = [weights[name] for name in ref_node.inputs[1:]]
    k = ref_node.op.a["top_k"]
    logits = (x.float() @ args[0].float().T).topk(k + 1, -1).values
    # the k-th expert's logit leads the next one's by more than bf16 rounding of the logits (2^-8 of them)
    clear = (logits[:, k - 1] - logits[:, k]) > 2**-6 * logits.abs().amax(-1)
    assert clear.sum() >= 24, "too few tokens with a clear expert choice: the check would test little"
    ref, fast = ref_node.op(None, x, *args), fast_node.op(None, x, *args)
    assert sqnr_db(ref[clear], fast[clear]) > 40


def test_fused_moe_checks_its_inputs():
    w13, s13, w2, s2 = experts(4, 16, 32)
    x = torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="disagree"):
        fused_moe(x, torch.randn(2, 5, device=DEVICE), w13, s13, w2, s2, 2, True)
    with pytest.raises(ValueError, match="w13 must be float8_e4m3fn"):
        fused_moe(x, torch.randn(2, 4, device=DEVICE), w13.float(), s13, w2, s2, 2, True)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(x, torch.randn(2, 4, device=DEVICE), w13, s13, w2, s2, 5, True)
    assert fused_moe(x[:0], torch.randn(0, 4, device=DEVICE), w13, s13, w2, s2, 2, True).shape == (0, 32)


# ---- configs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 4, 16, 64, 512, 8192])
@pytest.mark.parametrize(("inter", "hidden"), [(768, 2048), (384, 4096)])
def test_configs_round_trip_and_default_comes_first(tokens, inter, hidden):
    cands = sweep_configs(tokens, 128, inter, hidden, 8)
    assert cands[0] == default_config(tokens, 128, inter, hidden, 8)
    assert len(set(cands)) == len(cands) >= 4
    for config in cands:
        record = config.to_dict() | {"us": 3.0}
        assert config_from_dict(record) == config
        KernelTable.from_dict({"device": "d", "entries": {"MoE:128x2x3:top8": {"1": record}}}, "t")
    # one token: the GEMV candidates first, then the grouped GEMMs'
    assert isinstance(cands[0], MoEGemvConfig) == (tokens == 1)
    assert any(isinstance(c, MoEConfig) for c in cands)
    # pairs per hit expert: <= 16 up to T = 256 (decode tiles), 32 at 512, 512 at 8192
    grouped = next(c for c in cands if isinstance(c, MoEConfig))
    assert grouped.block_m == {1: 16, 4: 16, 16: 16, 64: 16, 512: 32, 8192: 64}[tokens]


def test_decode_default_fills_the_sms():
    config = grouped_config(1, 128, 768, 2048, 8)  # 8 experts hit, 16-row blocks
    assert config.block_m == 16
    assert 8 * -(-768 // config.w13.block_n) >= 132 and 8 * -(-2048 // config.w2.block_n) >= 132
    gemv = default_config(1, 128, 768, 2048, 8)  # the GEMVs: ~768 programs of the up projection
    assert isinstance(gemv, MoEGemvConfig) and 8 * 768 // gemv.up.block_n == 768


def test_gemv_records_are_checked_by_key():
    record = MoEGemvConfig(GemvTile(8, 1024, 2), GemvTile(16, 128, 2)).to_dict()
    for bad, match in (
        ({"gemv": 2}, "gemv must be 1"),
        ({"up_block_n": 3}, "up_block_n"),
        ({"down_num_warps": 32}, "down_num_warps"),
    ):
        with pytest.raises(ValueError, match=match):
            KernelTable.from_dict({"device": "d", "entries": {"MoE:8x2x3:top2": {"1": record | bad}}}, "t")
    with pytest.raises(ValueError, match="lacks"):
        config_from_dict({"gemv": 1, "up_block_n": 8})
    with pytest.raises(ValueError, match="block_n"):
        GemvTile(3, 64)
    with pytest.raises(ValueError, match="block_k"):
        GemvTile(4, 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("num_experts", "top_k", "inter", "hidden"), [(10, 3, 40, 72), (8, 2, 48, 64), (6, 1, 24, 40)])
def test_one_token_gemvs_give_the_grouped_gemms_rows(num_experts, top_k, inter, hidden, dtype):
    """moe_up_one / moe_down_one against moe_up_silu / moe_down over the same routing: the same
    math with the K sums in another order (fp32), so act and the weighted rows agree to a rounding
    (bf16) or fp32 summation order; every tile size leaves tails in N and K."""
    x = torch.randn(1, hidden).to(dtype).to(DEVICE)
    logits = torch.randn(1, num_experts, device=DEVICE)
    (weights, ids, xq, xs), layout = moe_route_quant_one(logits, x, top_k, True, 16)
    w13, s13, w2, s2 = experts(num_experts, inter, hidden)
    blocks = PairBlocks(*layout, 16, top_k, top_k)
    act_ref = moe_up_silu(xq, xs, w13, s13, blocks, dtype, block_n=32, block_k=32, num_warps=4, num_stages=2)
    pairs_ref = moe_down(act_ref, w2, s2, weights, blocks, block_n=32, block_k=32, num_warps=4, num_stages=2)
    for up, down in ((GemvTile(16, 32, 2), GemvTile(8, 16, 1)), (GemvTile(1, 16, 1), GemvTile(32, 64, 4))):
        act = moe_up_one(xq, xs, w13, s13, ids, dtype, up)
        assert act.shape == (top_k, inter)
        assert rounding_misses(act, act_ref[::16][:top_k]) == 0  # slot s at list position 16 s
        pairs = moe_down_one(act_ref[::16][:top_k].contiguous(), w2, s2, weights, ids, down)
        assert pairs.shape == (top_k, hidden)
        assert rounding_misses(pairs, pairs_ref) == 0
    with pytest.raises(ValueError, match="topk_ids"):
        moe_up_one(xq, xs, w13, s13, ids.long(), dtype, up)
    with pytest.raises(ValueError, match="xq"):
        moe_up_one(x, xs, w13, s13, ids, dtype, up)
    with pytest.raises(ValueError, match="act"):
        moe_down_one(act_ref, w2, s2, weights, ids, down)


def test_config_validation():
    with pytest.raises(ValueError, match="block_m"):
        MoEConfig(24, TileConfig(32, 32), TileConfig(32, 32))
    with pytest.raises(ValueError, match="block_k"):
        TileConfig(32, 16)
    with pytest.raises(ValueError, match="lacks"):
        MoEConfig.from_dict({"block_m": 16})
