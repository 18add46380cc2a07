"""The runtime's torch reference ops against independent references: torch._scaled_mm for the FP8
GEMM, transformers' RMSNorm and RoPE, scaled_dot_product_attention for paged attention, and the
unfused compositions of docs/OPS.md for the fused ops."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS
from qruntime.ops import functional as fn
from qruntime.ops.attention import PagedAttention, QKNormRoPEKVWrite
from qruntime.ops.base import AttentionMetadata, OpEnv, StepContext
from qruntime.ops.moe import MoE
from qruntime.ops.registry import reference_ops, triton_ops
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from qcompile.graph.ops import SIGNATURES, STANDARD_OPS


def test_registry_implements_every_op_the_compiler_emits():
    registry = reference_ops()
    assert {("", op) for op in STANDARD_OPS} | {("qcompile", op) for op in SIGNATURES} <= set(registry)


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_ptpc_linear_equals_scaled_mm(rows):
    k, n = random.choice([(64, 48), (96, 40), (128, 256)])
    x = torch.randn(rows, k, dtype=torch.bfloat16) * 3
    w = torch.randn(n, k) * 0.05
    ws = (w.abs().amax(1, keepdim=True) / 448).to(torch.bfloat16)
    wq = (w / ws.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
    xq, xs = fn.dynamic_quant(x, 0)
    # fp32 out: the two accumulate in different orders, which a bf16 output would round apart now and then
    ours = fn.ptpc_linear(xq, xs, wq, ws, torch.float32)
    library = torch._scaled_mm(xq, wq.T, scale_a=xs, scale_b=ws.float().T, out_dtype=torch.float32)
    assert torch.allclose(ours, library, rtol=1e-5, atol=2e-5)  # outputs ~1: fp32 sums of 128 terms
    # and the result is not a dequantized shortcut: the unquantized product differs by the fp8 error
    assert not torch.allclose(ours, (x.float() @ w.T), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("group_size", [0, 32])
def test_dynamic_quant_is_per_token_e4m3(group_size):
    x = torch.randn(9, 96) * torch.rand(9, 1) * 10
    xq, xs = fn.dynamic_quant(x, group_size)
    groups = 1 if group_size == 0 else 96 // group_size
    assert xq.dtype == torch.float8_e4m3fn and xs.shape == (9, groups)
    dequant = (xq.float().reshape(9, groups, -1) * xs[..., None]).reshape(9, 96)
    # the largest |x| of each group maps to +-448 exactly; every value within half an e4m3 step (2^-4 relative)
    assert torch.equal(xq.float().reshape(9, groups, -1).abs().amax(-1), torch.full((9, groups), 448.0))
    assert torch.all((dequant - x).abs() <= x.abs() * 2**-4 + xs.repeat_interleave(96 // groups, 1) * 2**-9)


@pytest.mark.parametrize("rows", [1, 2, 13])
def test_dynamic_quant_per_tensor_is_one_scale_for_the_step(rows):
    """group_size -1: s = max(amax(|x|) / 448, 1e-12) over every token in fp32, xq = fp8(clamp(x / s)),
    xs [T, 1] holding s on every row — the per-token formula with the whole step as the group."""
    x = (torch.randn(rows, 80) * torch.rand(rows, 1) * 10).to(torch.bfloat16)
    xq, xs = fn.dynamic_quant(x, -1)
    s = torch.clamp(x.float().abs().max() / 448.0, min=1e-12)
    expected = (x.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    assert xq.dtype == torch.float8_e4m3fn and xs.dtype == torch.float32 and xs.shape == (rows, 1)
    assert torch.equal(xs, s.expand(rows, 1)) and xs.is_contiguous()
    assert torch.equal(xq.view(torch.uint8), expected.view(torch.uint8))
    # one row's quantization is per-token's on the same row when it holds the step's amax
    top = int(x.float().abs().amax(-1).argmax())
    row_q, row_s = fn.dynamic_quant(x[top : top + 1], 0)
    assert torch.equal(row_s, xs[top : top + 1]) and torch.equal(
        row_q.view(torch.uint8), xq[top : top + 1].view(torch.uint8)
    )
    # and PTPCLinear consumes it as it does per-token scales
    w = (torch.randn(24, 80) * 0.05).to(torch.float8_e4m3fn)
    ws = torch.rand(24, 1, dtype=torch.bfloat16) * 1e-2
    y = fn.ptpc_linear(xq, xs, w, ws, torch.float32)
    assert torch.allclose(y, (xq.float() @ w.float().T) * s * ws.float().T, rtol=1e-6, atol=1e-6)


def test_dynamic_quant_per_tensor_of_an_empty_step_and_of_zeros():
    xq, xs = fn.dynamic_quant(torch.zeros(0, 16, dtype=torch.bfloat16), -1)
    assert xq.shape == (0, 16) and xs.shape == (0, 1)
    xq, xs = fn.dynamic_quant(torch.zeros(3, 16, dtype=torch.bfloat16), -1)
    assert bool((xs == 1e-12).all()) and not xq.float().any()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("op", ["DynamicQuant", "AddRMSNormQuant", "SiluMulQuant"])
def test_fast_op_table_binds_no_kernel_for_per_tensor_quant(op):
    """The Triton quantization kernels are per token: with group_size -1 the fast op table's op binds
    none and computes exactly what the reference op does."""
    fast_table, ref_table = triton_ops(), reference_ops()
    env = OpEnv(torch.bfloat16, torch.device("cpu"), _spec("nhd", "bf16"))
    attrs = {"group_size": -1} | ({"epsilon": 1e-6} if op == "AddRMSNormQuant" else {})
    fast, ref = fast_table[("qcompile", op)](attrs, env), ref_table[("qcompile", op)](attrs, env)
    assert type(fast).__module__ == "qruntime.ops.triton_ops" and fast.kernel is None
    assert fast_table[("qcompile", op)]({**attrs, "group_size": 0}, env).kernel is not None  # per token: bound
    x = torch.randn(5, 64, dtype=torch.bfloat16) * 4
    args = {
        "DynamicQuant": (x,),
        "AddRMSNormQuant": (x, torch.randn_like(x), torch.randn(64, dtype=torch.bfloat16)),
        "SiluMulQuant": (x,),
    }[op]
    got, want = fast(None, *args), ref(None, *args)
    assert got[1].shape == (5, 1)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_block_fp8_linear_equals_dequantized_matmul():
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    w = (torch.randn(192, 256) * 0.02).to(torch.float8_e4m3fn)
    ws = torch.rand(2, 2, dtype=torch.bfloat16) + 0.5
    xq, xs = fn.dynamic_quant(x, 128)
    ours = fn.block_fp8_linear(xq, xs, w, ws, 128, 128, torch.float32)
    wd = w.double() * ws.double().repeat_interleave(128, 0)[:192].repeat_interleave(128, 1)
    xd = xq.double() * xs.double().repeat_interleave(128, 1)
    assert torch.allclose(ours.double(), xd @ wd.T, rtol=1e-5, atol=1e-5)


def test_rms_norm_and_rope_equal_transformers():
    t, heads, d = 7, 3, 32
    x = torch.randn(t, heads, d, dtype=torch.bfloat16)
    norm = Qwen3RMSNorm(d, eps=1e-6).to(torch.bfloat16)
    norm.weight.data = torch.randn(d, dtype=torch.bfloat16)
    assert torch.equal(fn.rms_norm(x, norm.weight.data, 1e-6), norm(x))
    xf = torch.randn(t, heads, d)
    positions = torch.randint(0, 5000, (t,))
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([positions.float()[:, None] * inv_freq] * 2, -1)
    # transformers' layout: [batch, heads, seq, d] with cos/sin [batch, seq, d]
    q_ref, _ = apply_rotary_pos_emb(
        xf.transpose(0, 1)[None], xf.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None]
    )
    assert torch.allclose(fn.rope(xf, positions, 1e6, d), q_ref[0].transpose(0, 1), atol=1e-6)


def _spec(layout: str, kv_dtype: str, block_size: int = 16, kvh: int = 2, d: int = 32) -> KVCacheSpec:
    return KVCacheSpec(KV_LAYOUTS[layout], kv_dtype, block_size, 2, kvh, d)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_every_layout_stores_and_gathers_the_same_values(kv_dtype):
    blocks, tokens = 12, 40
    slots = torch.randperm(blocks * 16)[:tokens]
    k, v = torch.randn(tokens, 2, 32, dtype=torch.bfloat16), torch.randn(tokens, 2, 32, dtype=torch.bfloat16)
    gathered = {}
    for layout in KV_LAYOUTS:
        cache = KVCache(_spec(layout, kv_dtype), blocks, torch.bfloat16, torch.device("cpu"))
        cache.write(1, k, v, slots, 0.5, 2.0)
        gathered[layout] = cache.gather(1, slots, 0.5, 2.0)
        assert not cache.k[0].any()  # another layer is untouched
    expected_k, expected_v = k.float(), v.float()
    if kv_dtype == "fp8_e4m3":
        expected_k = (k.float() / 0.5).to(torch.float8_e4m3fn).float() * 0.5
        expected_v = (v.float() / 2.0).to(torch.float8_e4m3fn).float() * 2.0
    for layout, (gk, gv) in gathered.items():
        assert torch.equal(gk, expected_k) and torch.equal(gv, expected_v), layout


def test_x_packed_places_elements_where_artifact_md_says():
    spec = _spec("x-packed", "bf16")
    x = spec.layout.pack("bf16")  # 8 bf16 per 16 bytes
    cache = KVCache(spec, 4, torch.bfloat16, torch.device("cpu"))
    k, v = torch.randn(1, 2, 32, dtype=torch.bfloat16), torch.randn(1, 2, 32, dtype=torch.bfloat16)
    slot = random.randrange(4 * 16)
    block, offset = divmod(slot, 16)
    cache.write(0, k, v, torch.tensor([slot]), 1.0, 1.0)
    head, dim = random.randrange(2), random.randrange(32)
    assert cache.k[0][block, head, dim // x, offset, dim % x] == k[0, head, dim]
    assert cache.v[0][block, head, offset // x, dim, offset % x] == v[0, head, dim]


def _paged_step(seqs: list[tuple[int, int]], spec: KVCacheSpec, blocks: int, nh: int):
    """A cache filled with random K/V for sequences given as (context_len, q_len), random block tables;
    returns the step context, the queries and per-sequence dense K/V."""
    cache = KVCache(spec, blocks, torch.float32, torch.device("cpu"))
    free = torch.randperm(blocks).tolist()
    starts, slots_per_seq, dense = [0], [], []
    for ctx, q_len in seqs:
        table = [free.pop() for _ in range(-(-ctx // spec.block_size))]
        pos = torch.arange(ctx)
        slots = torch.tensor(table)[pos // spec.block_size] * spec.block_size + pos % spec.block_size
        k, v = torch.randn(ctx, spec.num_kv_heads, spec.head_dim), torch.randn(ctx, spec.num_kv_heads, spec.head_dim)
        cache.write(0, k, v, slots, 1.0, 1.0)
        slots_per_seq.append(slots)
        dense.append((k, v))
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(tuple(starts), tuple(c for c, _ in seqs), tuple(slots_per_seq))
    q = torch.randn(starts[-1], nh, spec.head_dim)
    return StepContext(cache, meta), q, dense


@pytest.mark.parametrize("layout", list(KV_LAYOUTS))
def test_paged_attention_equals_sdpa_for_prefill_decode_and_mixed(layout):
    spec, nh = _spec(layout, "bf16", kvh=2, d=32), 6
    # a full prefill, a decode over a long context, a prefill chunk after a cached prefix, a 1-token prompt
    seqs = [(37, 37), (61, 1), (50, 13), (1, 1)]
    step, q, dense = _paged_step(seqs, spec, 32, nh)
    attrs = {"layer": 0, "layout": layout, "block_size": 16, "kv_dtype": "bf16", "k_scale": 1.0, "v_scale": 1.0}
    attrs |= {"num_heads": nh, "num_kv_heads": 2, "head_dim": 32, "scale": 32**-0.5}
    op = PagedAttention(attrs, OpEnv(torch.float32, torch.device("cpu"), spec))
    out = op(step, q, None, None, None, None)
    for b, ((ctx, q_len), (k, v)) in enumerate(zip(seqs, dense, strict=True)):
        qb = q[step.attn.query_start[b] : step.attn.query_start[b + 1]]
        mask = torch.arange(ctx)[None] <= torch.arange(ctx - q_len, ctx)[:, None]
        ref = F.scaled_dot_product_attention(
            qb.transpose(0, 1),
            k.repeat_interleave(3, 1).transpose(0, 1),
            v.repeat_interleave(3, 1).transpose(0, 1),
            attn_mask=mask,
        )
        assert torch.allclose(
            out[step.attn.query_start[b] : step.attn.query_start[b + 1]],
            ref.transpose(0, 1).reshape(q_len, -1),
            atol=1e-5,
        )


def test_qknorm_rope_kvwrite_equals_its_unfused_form():
    spec, nh, kvh, d = _spec("hnd", "fp8_e4m3", kvh=2, d=32), 4, 2, 32
    attrs = {"layer": 1, "layout": "hnd", "block_size": 16, "kv_dtype": "fp8_e4m3", "k_scale": 0.25, "v_scale": 0.5}
    attrs |= {"num_heads": nh, "num_kv_heads": kvh, "head_dim": d, "epsilon": 1e-6, "theta": 1e6}
    env = OpEnv(torch.bfloat16, torch.device("cpu"), spec)
    cache = KVCache(spec, 4, torch.bfloat16, torch.device("cpu"))
    t = 9
    qkv = torch.randn(t, (nh + 2 * kvh) * d, dtype=torch.bfloat16)
    qw, kw = torch.randn(d, dtype=torch.bfloat16), torch.randn(d, dtype=torch.bfloat16)
    positions, slots = torch.arange(20, 20 + t), torch.randperm(64)[:t]
    q, _ = QKNormRoPEKVWrite(attrs, env)(StepContext(cache, None), qkv, qw, kw, positions, slots)
    q_ref, k_ref, v_ref = torch.split(qkv, [nh * d, kvh * d, kvh * d], -1)
    q_ref = fn.rope(fn.rms_norm(q_ref.reshape(t, nh, d), qw, 1e-6), positions, 1e6, d)
    k_ref = fn.rope(fn.rms_norm(k_ref.reshape(t, kvh, d), kw, 1e-6), positions, 1e6, d)
    k_got, v_got = cache.gather(1, slots, 0.25, 0.5)
    assert torch.equal(q, q_ref)
    assert torch.equal(k_got, (k_ref.float() / 0.25).to(torch.float8_e4m3fn).float() * 0.25)
    assert torch.equal(v_got, (v_ref.float().reshape(t, kvh, d) / 0.5).to(torch.float8_e4m3fn).float() * 0.5)


@pytest.mark.parametrize("linear", ["Gemm", "PTPCLinear"])
@pytest.mark.parametrize("norm_topk_prob", [0, 1])
def test_moe_equals_every_expert_on_every_token_summed_in_expert_order(linear, norm_topk_prob):
    t, h, inter, experts, top_k = 11, 64, 24, 6, 2
    x = torch.randn(t, h)
    router = torch.randn(experts, h)
    w13, w2 = torch.randn(experts, 2 * inter, h) * 0.1, torch.randn(experts, h, inter) * 0.1
    s13 = s2 = None
    if linear == "PTPCLinear":
        s13 = w13.abs().amax(-1, keepdim=True) / 448
        s2 = w2.abs().amax(-1, keepdim=True) / 448
        w13, w2 = (w13 / s13).to(torch.float8_e4m3fn), (w2 / s2).to(torch.float8_e4m3fn)
    attrs = {
        "num_experts": experts,
        "top_k": top_k,
        "norm_topk_prob": norm_topk_prob,
        "linear": linear,
        "group_size": 0,
    }
    env = OpEnv(torch.float32, torch.device("cpu"), _spec("nhd", "bf16"))
    got = MoE(attrs, env)(None, x, router, w13, s13, w2, s2)

    def dense(x, w, s):  # the unfused form: DynamicQuant + PTPCLinear, or Gemm
        return x @ w.T if s is None else fn.ptpc_linear(*fn.dynamic_quant(x, 0), w, s, torch.float32)

    weights, ids = fn.moe_routing(x @ router.T, top_k, bool(norm_topk_prob))
    if norm_topk_prob:
        assert torch.allclose(weights.sum(-1), torch.ones(t))
    total = torch.zeros(t, h)
    for e in range(experts):
        act = fn.silu_mul(dense(x, w13[e], None if s13 is None else s13[e]))
        coef = (weights * (ids == e)).sum(-1, keepdim=True)
        total = total + dense(act, w2[e], None if s2 is None else s2[e]) * coef
    assert torch.allclose(got, total, atol=1e-5)


def test_moe_per_tensor_scales_x_once_and_all_routed_activations_once():
    """group_size -1 (tensor-fp8): x quantized with one scale for the step; the SiLU-mul outputs of
    every routed (token, expert) pair with one scale for all of them together (vLLM's fused MoE)."""
    t, h, inter, experts, top_k = 13, 64, 24, 6, 2
    x = torch.randn(t, h) * torch.rand(t, 1) * 4
    router = torch.randn(experts, h)
    w13, w2 = torch.randn(experts, 2 * inter, h) * 0.1, torch.randn(experts, h, inter) * 0.1
    s13, s2 = w13.abs().amax((1, 2), keepdim=True) / 448, w2.abs().amax((1, 2), keepdim=True) / 448
    s13, s2 = s13.expand(-1, 2 * inter, 1).contiguous(), s2.expand(-1, h, 1).contiguous()  # per tensor, on every row
    w13, w2 = (w13 / s13).to(torch.float8_e4m3fn), (w2 / s2).to(torch.float8_e4m3fn)
    attrs = {"num_experts": experts, "top_k": top_k, "norm_topk_prob": 1, "linear": "PTPCLinear", "group_size": -1}
    env = OpEnv(torch.float32, torch.device("cpu"), _spec("nhd", "bf16"))
    got = MoE(attrs, env)(None, x, router, w13, s13, w2, s2)

    weights, ids = fn.moe_routing(x @ router.T, top_k, True)
    x_scale = x.abs().max() / 448
    xq = (x / x_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    pairs = [(e, *torch.where(ids == e)) for e in range(experts) if (ids == e).any()]
    acts = [fn.silu_mul((xq[tok].float() @ w13[e].float().T) * x_scale * s13[e].T) for e, tok, _ in pairs]
    a_scale = torch.cat(acts).abs().max() / 448  # one scale over all routed pairs
    total = torch.zeros(t, h)
    for (e, tok, slot), act in zip(pairs, acts, strict=True):
        aq = (act / a_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        total.index_add_(0, tok, (aq.float() @ w2[e].float().T) * a_scale * s2[e].T * weights[tok, slot, None])
    assert torch.allclose(got, total, rtol=1e-5, atol=1e-5)
    # the scale really is shared: each expert scaling its own activations gives another result
    own = torch.zeros(t, h)
    for (e, tok, slot), act in zip(pairs, acts, strict=True):
        aq, a_s = fn.dynamic_quant(act, -1)
        own.index_add_(0, tok, (aq.float() @ w2[e].float().T) * a_s * s2[e].T * weights[tok, slot, None])
    assert not torch.allclose(got, own, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_fast_attention_takes_sdpa_for_fresh_long_prompts_only(kv_dtype):
    """The triton op table's PagedAttention runs a step of fresh prompts (no cached prefix, each
    >= SDPA_MIN_TOKENS) with torch's fused attention: same result as the reference op; a step with
    a cached prefix or a short prompt goes to the varlen prefill kernel."""
    from qruntime.ops.triton_ops import PagedAttention as FastPagedAttention

    spec, nh = _spec("nhd", kv_dtype, kvh=2, d=32), 6
    n = FastPagedAttention.SDPA_MIN_TOKENS
    seqs = [(n + random.randrange(1, 40), 0), (n + random.randrange(1, 40), 0)]
    seqs = [(ctx, ctx) for ctx, _ in seqs]
    step, q, _ = _paged_step(seqs, spec, 2 * (n // 16 + 4), nh)
    scales = (0.5, 0.25) if kv_dtype == "fp8_e4m3" else (1.0, 1.0)
    attrs = {"layer": 0, "layout": "nhd", "block_size": 16, "kv_dtype": kv_dtype, "k_scale": scales[0]}
    attrs |= {"v_scale": scales[1], "num_heads": nh, "num_kv_heads": 2, "head_dim": 32, "scale": 32**-0.5}
    env = OpEnv(torch.float32, torch.device("cpu"), spec)
    fast, ref = FastPagedAttention(attrs, env), PagedAttention(attrs, env)
    calls = []
    fast.prefill = lambda *args, **kwargs: calls.append(args)
    out = fast(step, q, None, None, None, None)
    assert not calls  # fresh long prompts: SDPA
    assert torch.allclose(out, ref(step, q, None, None, None, None), atol=1e-5)

    short = AttentionMetadata((0, 5), (5,), step.attn.cache_slots[:1])
    prefix = AttentionMetadata((0, n), (n + 3,), step.attn.cache_slots[:1])
    for meta in (short, prefix):
        fast(StepContext(step.kv_cache, meta), q[: meta.query_start[-1]], None, None, None, None)
    assert len(calls) == 2
