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
from qruntime.kernels.silu_mul_quant import silu_mul_quant
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


_COMPILE = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qruntime.kernels import dynamic_quant as dq
names = ("x_ptr", "q_ptr", "s_ptr", "K", "stride_x")
types = dict(zip(names, ("*bf16", "*u8", "*fp32", "i32", "i32")))
consts = {"BLOCK": 4096, "NUM_CHUNKS": 1, "HW": True, "PDL": False, "FNUZ": sys.argv[1] == "1"}
source = ASTSource(dq._dynamic_quant_kernel, {**types, **{k: "constexpr" for k in consts}}, constexprs=consts)
print(triton.compile(source, target=GPUTarget("hip", "gfx942", 64), options={"num_warps": 8}).asm["amdgcn"])
"""


def _gfx942(fnuz: bool) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE, "1" if fnuz else "0"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_quantization_compiles_for_gfx942_with_its_own_fp8_conversion():
    """With FNUZ the codes come from gfx942's packed FP8 conversion (v_cvt_pk_fp8_f32, e4m3fnuz in
    hardware); without it e4m3fn is emulated in integer code there (no such instruction)."""
    fnuz, ocp = _gfx942(True), _gfx942(False)
    assert "v_cvt_pk_fp8_f32" in fnuz
    assert "v_cvt_pk_fp8_f32" not in ocp
