"""The amd-gfx942 target's FP8 (float8_e4m3fnuz, qruntime.target) in the Triton kernels: the
per-token quantization writes e4m3fn's codes as e4m3fnuz (0x80, e4m3fn's -0, as 0) with the scales
doubled — qruntime.target.to_e4m3fnuz of the e4m3fn result, so xq * xs is unchanged — checked under
the interpreter (CI) and, where it runs, on a GPU; and its hardware branch compiles for gfx942 (an
MI300's code object, built here without one) using gfx942's own FP8 conversion."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from qruntime.kernels.dynamic_quant import dynamic_quant
from qruntime.target import to_e4m3fnuz

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
