"""The amd-gfx942 target's FP8 (float8_e4m3fnuz, qruntime.target) in the Triton kernels: every
quantizing kernel (dynamic_quant, AddRMSNorm-quant, SiLU-mul-quant, the MoE routing) writes e4m3fn's
codes as e4m3fnuz (0x80, e4m3fn's -0, as 0) with the scales doubled — qruntime.target.to_e4m3fnuz of
the e4m3fn result, so xq * xs is unchanged — and every kernel reading FP8 (the PTPC GEMM, its GEMV
with the quantization folded in, the fused MoE's grouped GEMMs and GEMVs) gives, on e4m3fnuz operands
with doubled scales, the e4m3fn kernels' output bit for bit (halving and doubling are exact); checked
under the interpreter (CI) and, where it runs, on a GPU. The hardware branches compile for gfx942 (an
MI300's code object, built here without one) using gfx942's own FP8 conversion."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from qruntime.kernels.add_rmsnorm_quant import add_rmsnorm_quant
from qruntime.kernels.dynamic_quant import dynamic_quant
from qruntime.kernels.fp8_gemm import GemmConfig, ptpc_fp8_gemm, ptpc_fp8_gemv_quant
from qruntime.kernels.fused_moe import MoEConfig, TileConfig, fused_moe
from qruntime.kernels.moe_gemv import GemvTile, MoEGemvConfig
from qruntime.kernels.paged_decode_attention import paged_decode_attention
from qruntime.kernels.paged_prefill_attention import paged_prefill_attention
from qruntime.kernels.qknorm_rope_kvwrite import qknorm_rope_kvwrite
from qruntime.kernels.silu_mul_quant import silu_mul_quant
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS
from qruntime.target import to_e4m3fnuz

FNUZ = torch.float8_e4m3fnuz

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("tokens", "width", "max_block"), [(1, 96, 8192), (6, 130, 8192), (4, 200, 64)])
def test_per_token_quantization_in_e4m3fnuz_is_e4m3fn_transcoded(rng, tokens, width, max_block):
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    x = torch.randn(tokens, width, generator=gen) * torch.logspace(-3, 3, tokens)[:, None]
    # exact zeros of both signs, and negatives small enough to round to zero: e4m3fn's -0 (0x80)
    x[:, :4] = torch.tensor([0.0, -0.0, -1e-9, 1e-9])
    x = x.bfloat16().to(DEVICE)
    fn_codes, fn_scales = dynamic_quant(x, max_block=max_block)
    assert (fn_codes.view(torch.uint8) == 0x80).any()  # the case that needs the care
    codes, scales = dynamic_quant(x, max_block=max_block, fp8=torch.float8_e4m3fnuz)
    want_codes, want_scales = to_e4m3fnuz(fn_codes, fn_scales)
    assert codes.dtype == torch.float8_e4m3fnuz
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales) and not torch.isnan(codes.float()).any()
    assert torch.equal(codes.float() * scales, fn_codes.float() * fn_scales)
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e4m3fnuz"):
        dynamic_quant(x, fp8=torch.float8_e5m2)


def _gen(rng) -> torch.Generator:
    return torch.Generator().manual_seed(rng.randrange(1 << 30))


def _rows(gen: torch.Generator, tokens: int, width: int) -> torch.Tensor:
    """bf16 rows of magnitudes 1e-3..1e3 with zeros of both signs and tiny negatives (e4m3fn's -0)."""
    x = torch.randn(tokens, width, generator=gen) * torch.logspace(-3, 3, tokens)[:, None]
    x[:, :4] = torch.tensor([0.0, -0.0, -1e-9, 1e-9])
    return x.bfloat16().to(DEVICE)


def _same(ours: tuple, theirs: tuple) -> None:
    """(fnuz codes, scales) equal to_e4m3fnuz of the e4m3fn (codes, scales), bit for bit."""
    want_codes, want_scales = to_e4m3fnuz(*theirs)
    assert ours[0].dtype == FNUZ
    assert torch.equal(ours[0].view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(ours[1], want_scales)


def _weights(gen: torch.Generator, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3fn weights (some -0 codes) and bf16 scales, as ptpc-fp8 stores them."""
    w = torch.randn(*shape, generator=gen)
    w[..., 0] = -0.0
    scale = (w.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12).bfloat16()
    return (w / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn).to(DEVICE), scale.to(DEVICE)


def _fnuz(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The amd-gfx942 artifact's copy: to_e4m3fnuz, the bf16 scales doubled (exact)."""
    return to_e4m3fnuz(w, scale)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize(("tokens", "hidden", "max_block"), [(3, 96, 8192), (2, 200, 64)])
def test_fused_norm_and_silu_quantization_in_e4m3fnuz_is_e4m3fn_transcoded(rng, tokens, hidden, max_block):
    """AddRMSNorm-quant (one tile, and the chunked path) and SiLU-mul-quant (one pass, two passes)."""
    gen = _gen(rng)
    x, res = _rows(gen, tokens, hidden), _rows(gen, tokens, hidden)
    w = (torch.rand(hidden, generator=gen) + 0.5).bfloat16().to(DEVICE)
    ours = add_rmsnorm_quant(x, res, w, 1e-6, max_block=max_block, fp8=FNUZ)
    theirs = add_rmsnorm_quant(x, res, w, 1e-6, max_block=max_block)
    _same(ours[:2], theirs[:2])
    assert torch.equal(ours[2], theirs[2])
    chunk = 64 if max_block == 64 else 4096
    gate_up = _rows(gen, tokens, 2 * hidden)
    _same(silu_mul_quant(gate_up, max_block=chunk, fp8=FNUZ), silu_mul_quant(gate_up, max_block=chunk))
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e4m3fnuz"):
        silu_mul_quant(gate_up, fp8=torch.float8_e5m2)


@pytest.mark.parametrize(
    "config", [GemmConfig(16, 32, 32, 1, 4, 2), GemmConfig(16, 32, 32, 4, 4, 2), GemmConfig(1, 4, 32, 1, 2, 1)]
)
def test_the_gemm_on_e4m3fnuz_operands_gives_the_e4m3fn_gemms_bits(rng, config):
    """Tiles (whole K, split-K with its reduction) and the one-token GEMV, also with the row's
    quantization folded in (ptpc_fp8_gemv_quant): e4m3fnuz codes at doubled scales, the same output."""
    gen = _gen(rng)
    tokens = 1 if config.block_m == 1 else 5
    x = _rows(gen, tokens, 200)
    w, ws = _weights(gen, 40, 200)
    wz, wsz = _fnuz(w, ws)
    xq, xs = dynamic_quant(x)
    theirs = ptpc_fp8_gemm(xq, xs, w, ws, torch.bfloat16, config)
    ours = ptpc_fp8_gemm(*dynamic_quant(x, fp8=FNUZ), wz, wsz, torch.bfloat16, config)
    assert torch.equal(_bits(ours), _bits(theirs))
    if config.block_m == 1:
        folded = ptpc_fp8_gemv_quant(x, wz, wsz, torch.bfloat16, config)
        assert torch.equal(_bits(folded), _bits(ptpc_fp8_gemv_quant(x, w, ws, torch.bfloat16, config)))
        assert torch.equal(_bits(folded), _bits(theirs))
    with pytest.raises(ValueError, match="both float8_e4m3fn or both float8_e4m3fnuz"):
        ptpc_fp8_gemm(xq, xs, wz, wsz, torch.bfloat16, config)  # e4m3fn activations, e4m3fnuz weights


@pytest.mark.parametrize(
    ("tokens", "config", "fused_router"),
    [
        (5, MoEConfig(16, TileConfig(32, 32, 4, 2), TileConfig(32, 32, 4, 2)), False),
        (1, MoEConfig(16, TileConfig(32, 32, 4, 2), TileConfig(32, 32, 4, 2)), False),
        (1, MoEGemvConfig(GemvTile(16, 32, 2), GemvTile(8, 16, 1)), True),
    ],
)
def test_the_fused_moe_on_e4m3fnuz_experts_gives_the_e4m3fn_moes_bits(rng, tokens, config, fused_router):
    """Routing + quantization, the grouped GEMMs (up/SiLU, down quantizing act on load) and the
    one-token GEMVs (the router fused into the routing launch, or not): on the amd artifact's
    experts, the activations in e4m3fnuz, the output equals the e4m3fn MoE's bit for bit."""
    gen = _gen(rng)
    experts, inter, hidden, top_k = 5, 24, 40, 2
    x = _rows(gen, tokens, hidden)
    w13, s13 = _weights(gen, experts, 2 * inter, hidden)
    w2, s2 = _weights(gen, experts, hidden, inter)
    router_w = (torch.randn(experts, hidden, generator=gen) * 0.1).bfloat16().to(DEVICE)
    logits = torch.nn.functional.linear(x, router_w)
    out = []
    for weights in ((w13, s13, w2, s2), (*_fnuz(w13, s13), *_fnuz(w2, s2))):
        router = (router_w, torch.zeros(1, dtype=torch.int32, device=DEVICE)) if fused_router else None
        out.append(fused_moe(x, None if fused_router else logits, *weights, top_k, True, config, router))
    assert torch.equal(_bits(out[0]), _bits(out[1]))
    with pytest.raises(ValueError, match="w2 of its format"):
        fused_moe(x, logits, w13, s13, *_fnuz(w2, s2), top_k, True, config)


def test_the_kv_write_and_attention_on_e4m3fnuz_pools_give_the_e4m3fn_ones_bits(rng):
    """An FP8 KV cache in e4m3fnuz: the QK-norm/RoPE/KV-write kernel stores e4m3fn's codes (-0 as 0)
    at the cache's k_scale / v_scale, the decode and prefill attention kernels read them at twice
    those scales: q, the pools' bytes (transcoded) and both attentions' outputs equal the e4m3fn
    cache's bit for bit. In the amd target's x-packed layout (the FP8 handling is the layouts' own)."""
    gen = _gen(rng)
    layout, nh, kvh, d, bs, tokens = "x-packed", 4, 2, 32, 16, 18
    spec = KVCacheSpec(KV_LAYOUTS[layout], "fp8_e4m3", bs, 1, kvh, d)
    fn_cache = KVCache(spec, 4, torch.bfloat16, DEVICE)
    pools = {"fn": (fn_cache.k[0], fn_cache.v[0])}
    pools["fnuz"] = tuple(torch.zeros_like(p.view(torch.uint8)).view(FNUZ) for p in pools["fn"])
    qkv = (torch.randn(tokens, (nh + 2 * kvh) * d, generator=gen) * 4).bfloat16().to(DEVICE)
    qkv[:, nh * d : nh * d + 4] = torch.tensor([0.0, -0.0, -1e-9, 1e-9])  # k: e4m3fn's -0
    norms = [(torch.rand(d, generator=gen) + 0.5).bfloat16().to(DEVICE) for _ in range(2)]
    table = torch.tensor([[3, 1]], dtype=torch.int32, device=DEVICE)
    pos = torch.arange(tokens, device=DEVICE)
    slots = table[0].long()[pos // bs] * bs + pos % bs
    scales = {"k_scale": rng.uniform(0.01, 0.05), "v_scale": rng.uniform(0.01, 0.05)}
    common = {"layout": KV_LAYOUTS[layout], "block_size": bs, **scales}
    attend = {**common, "scale": d**-0.5, "num_kv_heads": kvh}
    lens = torch.tensor([tokens], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, tokens], dtype=torch.int32, device=DEVICE)
    out = {}
    for name, (k_pool, v_pool) in pools.items():
        q = qknorm_rope_kvwrite(
            qkv, *norms, pos, slots, k_pool, v_pool,
            num_heads=nh, num_kv_heads=kvh, head_dim=d, eps=1e-6, theta=1e6, **common,
        )  # fmt: skip
        decode = paged_decode_attention(q[-1:], k_pool, v_pool, table, lens, **attend)
        prefill = paged_prefill_attention(q, k_pool, v_pool, table, lens, starts, max_q_len=tokens, **attend)
        out[name] = (q, decode, prefill)
    fn_bytes = [p.view(torch.uint8) for p in pools["fn"]]
    assert (fn_bytes[0] == 0x80).any()  # the -0 codes, written as 0 in e4m3fnuz
    for ours, theirs in zip(pools["fnuz"], fn_bytes, strict=True):
        assert torch.equal(ours.view(torch.uint8), torch.where(theirs == 0x80, 0, theirs))
    for ours, theirs in zip(out["fnuz"], out["fn"], strict=True):
        assert torch.equal(_bits(ours), _bits(theirs))


# every kernel changed for e4m3fnuz, compiled for gfx942 with FNUZ (its FP8 operands fp8e4b8): one
# subprocess, ~10 s here; prints each kernel's FP8 instructions
_COMPILE_ALL = r"""
import re, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qruntime.kernels import dynamic_quant as dq, fp8_gemm as g, add_rmsnorm_quant as an, silu_mul_quant as sm
from qruntime.kernels import moe_routing as mr, moe_gemm as mg, moe_gemv as mv

TARGET = GPUTarget("hip", "gfx942", 64)
F8 = "*fp8e4b8"

def build(fn, types, consts, warps=4):
    sig, cst = {}, {}
    for p in fn.params:
        if p.is_constexpr:
            v = consts.get(p.name, p.default)
            sig[p.name] = "constexpr"; cst[p.name] = v
        elif p.name in consts:  # a None pointer
            sig[p.name] = "constexpr"; cst[p.name] = consts[p.name]
        else:
            sig[p.name] = types.get(p.name, "*fp32" if p.name.endswith("_ptr") else "i32")
    src = ASTSource(fn, sig, constexprs=cst)
    return triton.compile(src, target=TARGET, options={"num_warps": warps}).asm["amdgcn"]

HW = {"HW": True, "PDL": False, "FNUZ": True}
jobs = {
  "dynamic_quant": (dq._dynamic_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*u8"}, {"BLOCK": 1024, "NUM_CHUNKS": 1, **HW}),
  "dynamic_quant_e4m3fn": (dq._dynamic_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*u8"},
      {"BLOCK": 1024, "NUM_CHUNKS": 1, **HW, "FNUZ": False}),
  "add_rmsnorm_quant": (an._add_rmsnorm_kernel, {p: "*bf16" for p in ("x_ptr", "r_ptr", "w_ptr", "ro_ptr")} | {"y_ptr": "*u8", "eps": "fp32"},
      {"SPLIT": 0, "SCALED": False, "HAS_RES": True, "QUANT": True, "BLOCK": 1024, "NUM_CHUNKS": 1, **HW}),
  "silu_mul_quant": (sm._silu_mul_quant_kernel, {"gu_ptr": "*bf16", "q_ptr": "*u8"},
      {"SPLIT": 0, "DTYPE": triton.language.bfloat16, "BLOCK": 1024, "NUM_CHUNKS": 2, **HW}),
  "ptpc_fp8_gemm": (g._ptpc_fp8_gemm_kernel, {"a_ptr": F8, "b_ptr": F8, "bs_ptr": "*bf16", "c_ptr": "*bf16"},
      {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 8, "EVEN_K": True, "ACC_PROMOTE_K": 128, "PDL": False, "PREFETCH_K": 0}),
  "ptpc_fp8_gemv_quant": (g._ptpc_fp8_gemv_kernel, {"a_ptr": "*bf16", "b_ptr": F8, "bs_ptr": "*bf16", "c_ptr": "*bf16"},
      {"NUM_K": 4, "BLOCK_N": 4, "BLOCK_K": 512, "EVEN_K": True, "PREFETCH_K": 0, "QUANT": True, "BLOCK_X": 2048, "NUM_X": 1, **HW}),
  "moe_route_quant": (mr._moe_route_quant_kernel, {"logits_ptr": "*bf16", "x_ptr": "*bf16", "ids_ptr": "*i32", "xq_ptr": "*u8"},
      {"TOP_K": 8, "NORM": True, "BLOCK_E": 128, "BLOCK_TOPK": 8, "BLOCK": 2048, "NUM_CHUNKS": 1,
       "sorted_ptr": None, "block_expert_ptr": None, "num_padded_ptr": None, "amax_ptr": None, **HW}),
  "moe_router_one": (mr._router_one_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "counter_ptr": "*i32", "ids_ptr": "*i32", "xq_ptr": "*u8",
      "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32"},
      {"TOP_K": 8, "NORM": True, "BLOCK_E": 128, "BLOCK_TOPK": 8, "BLOCK_M": 16, "BLOCK_PAIRS": 128, "EXPERTS": 1, "BLOCK_H": 2048, "SLICE": 16, **HW}),
  "moe_up_silu": (mg._moe_up_silu_kernel, {"xq_ptr": F8, "w_ptr": F8, "ws_ptr": "*bf16", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
      "num_padded_ptr": "*i32", "act_ptr": "*bf16"},
      {"TOP_K": 8, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "EVEN_K": True, "ACC_PROMOTE_K": 128, "HW": True, "PDL": False}),
  "moe_down": (mg._moe_down_kernel, {"act_ptr": "*bf16", "w_ptr": F8, "ws_ptr": "*bf16", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
      "num_padded_ptr": "*i32", "out_ptr": "*bf16"},
      {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "EVEN_K": True, "ACC_PROMOTE_K": 128, **HW}),
  "moe_up_one": (mv._moe_up_one_kernel, {"xq_ptr": F8, "w_ptr": F8, "ws_ptr": "*bf16", "ids_ptr": "*i32", "act_ptr": "*bf16"},
      {"NUM_K": 4, "BLOCK_N": 16, "BLOCK_K": 512, "EVEN_K": True, "HW": True, "PDL": False}),
  "moe_down_one": (mv._moe_down_one_kernel, {"act_ptr": "*bf16", "w_ptr": F8, "ws_ptr": "*bf16", "ids_ptr": "*i32", "out_ptr": "*bf16"},
      {"NUM_K": 4, "BLOCK_N": 8, "BLOCK_K": 256, "BLOCK_I": 1024, "EVEN_K": True, **HW}),
}
names = sys.argv[1:] or list(jobs)
for name in names:
    fn, types, consts = jobs[name]
    asm = build(fn, types, consts)
    ops = sorted(set(re.findall(r"\b(v_cvt_\w*fp8\w*|v_cvt_\w*bf8\w*|v_mfma_\w*fp8\w*|v_dot\w*fp8\w*)", asm)))
    print(f"{name}\t{' '.join(ops) or '-'}", flush=True)

# the FP8 KV cache's kernels: their launches on an e4m3fnuz x-packed cache captured from the
# wrappers (on CPU tensors), then compiled for gfx942 with the GPU's branches
import torch
from triton.runtime.jit import JITFunction
from qruntime.kernels.paged_decode_attention import paged_decode_attention
from qruntime.kernels.paged_prefill_attention import paged_prefill_attention
from qruntime.kernels.qknorm_rope_kvwrite import qknorm_rope_kvwrite
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS

PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
       torch.int64: "*i64", torch.uint8: "*u8", torch.float8_e4m3fnuz: "*fp8e4b8"}
launches = []

def capture(self, *args, grid, warmup, **kwargs):  # a launch, recorded instead of run
    launches.append((self, args, kwargs))

JITFunction.run = capture

def compile_gfx942(fn, args, kwargs):
    sig, consts = {}, {}
    it = iter(args)
    for p in fn.params:
        if p.is_constexpr:
            v = kwargs.get(p.name, p.default)
            v = {"HW": True, "UPCAST": False}.get(p.name, v)  # the GPU's branch (captured on CPU tensors)
            sig[p.name], consts[p.name] = "constexpr", v
            continue
        a = next(it)
        if isinstance(a, torch.Tensor):
            sig[p.name] = PTR[a.dtype]
        elif isinstance(a, bool):
            sig[p.name] = "i1"
        elif isinstance(a, int):
            sig[p.name] = "i32" if -2**31 <= a < 2**31 else "i64"
        elif isinstance(a, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{p.name}: {type(a)}")
    opts = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("hip", "gfx942", 64), options=opts).asm["amdgcn"]

nh, kvh, d, bs, T = 8, 2, 128, 16, 20
spec = KVCacheSpec(KV_LAYOUTS["x-packed"], "fp8_e4m3", bs, 1, kvh, d)
cache = KVCache(spec, 4, torch.bfloat16, "cpu")
k_pool, v_pool = (p.view(torch.uint8).view(torch.float8_e4m3fnuz) for p in (cache.k[0], cache.v[0]))
qkv = torch.randn(T, (nh + 2 * kvh) * d).bfloat16()
w = torch.ones(d).bfloat16()
pos = torch.arange(T); table = torch.tensor([[0, 1]], dtype=torch.int32)
common = dict(layout=KV_LAYOUTS["x-packed"], block_size=bs, k_scale=0.02, v_scale=0.03)
qknorm_rope_kvwrite(qkv, w, w, pos, pos, k_pool, v_pool, num_heads=nh, num_kv_heads=kvh, head_dim=d, eps=1e-6, theta=1e6, **common)
q = torch.randn(T, nh, d).bfloat16()
lens = torch.tensor([T], dtype=torch.int32)
att = dict(common, scale=d**-0.5, num_kv_heads=kvh)
paged_decode_attention(q[-1:], k_pool, v_pool, table, lens, num_splits=2, **att)
paged_prefill_attention(q, k_pool, v_pool, table, lens, torch.tensor([0, T], dtype=torch.int32), max_q_len=T, **att)
for fn, args, kwargs in launches:
    asm = compile_gfx942(fn, args, kwargs)
    ops = sorted(set(re.findall(r"\b(v_cvt_\w*fp8\w*|v_mfma_\w*)", asm)))
    print(f"{fn.__name__.strip('_').removesuffix('_kernel')}\t{' '.join(ops) or '-'}", flush=True)
"""

# what each must use: gfx942's e4m3fnuz conversion from fp32 (quantizing), its fp8 MFMA (tiles),
# its conversion of fp8 codes to fp32 (GEMVs on the vector units)
_QUANT, _MFMA, _WIDEN = "v_cvt_pk_fp8_f32", "_fp8_fp8", "v_cvt_pk_f32_fp8"
_EXPECTED = {
    "dynamic_quant": (_QUANT,),
    "dynamic_quant_e4m3fn": (),  # gfx942 has no e4m3fn conversion: emulated in integer code
    "add_rmsnorm_quant": (_QUANT,),
    "silu_mul_quant": (_QUANT,),
    "ptpc_fp8_gemm": (_MFMA,),
    "ptpc_fp8_gemv_quant": (_QUANT, _WIDEN),
    "moe_route_quant": (_QUANT,),
    "moe_router_one": (_QUANT,),
    "moe_up_silu": (_MFMA,),
    "moe_down": (_QUANT, _MFMA),
    "moe_up_one": (_WIDEN,),
    "moe_down_one": (_QUANT, _WIDEN),
    "qknorm_rope_kvwrite": (_QUANT,),
    "decode_partition": (_WIDEN,),
    "decode_reduce": (),  # fp32 partials only
    "prefill": (_WIDEN,),
}


def test_every_fnuz_kernel_compiles_for_gfx942_with_its_fp8_instructions():
    """The hardware branch (HW, FNUZ) of each kernel that reads or writes FP8, built for the MI300's
    code object: it compiles, and its FP8 work is gfx942's own e4m3fnuz instructions."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_ALL], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = dict(line.split("\t") for line in done.stdout.splitlines() if "\t" in line)
    assert found.keys() == _EXPECTED.keys(), done.stdout
    for name, needed in _EXPECTED.items():
        for instr in needed:
            assert instr in found[name], f"{name}: no {instr} in {found[name]}"
    assert _QUANT not in found["dynamic_quant_e4m3fn"]
