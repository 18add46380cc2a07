"""Per-token dynamic FP8 quantization (the `DynamicQuant` op with group_size 0).

Reference: qruntime.ops.functional.dynamic_quant(x, 0): per row, in fp32,
    s = max(amax(|x|) / 448, 1e-12),  xq = fp8_e4m3(clamp(x / s, -448, 448)),
with IEEE division and round-to-nearest-even into e4m3. The kernel reproduces it bit for bit:
the scale with tl.math.div_rn (Triton's `/` on fp32 is an approximate division on the GPU), x / s
with a reciprocal and Markstein's fma correction (the IEEE quotient at three fp32 ops an element).
Note that torch itself on CUDA computes amax / 448 as amax * (1/448), one ulp off in some rows, so
the CPU reference is the one matched exactly (bench/gpu_kernels/quant.py counts the difference).

One program per token row. A row that fits one tile (BLOCK = next_power_of_2(K) <= MAX_BLOCK)
is loaded once, reduced and quantized from registers; a longer row is read in column chunks
twice (pass 1: amax, pass 2: quantize; the second read mostly hits L2).

This module also holds the helpers the fused quantizing kernels share (add_rmsnorm_quant.py,
silu_mul_quant.py): the launch configuration of a row kernel, rounding to the model dtype, the
scale and the e4m3 encoder. Compiled for a GPU, rounding uses the hardware conversions (cvt.rn to
bf16 and e4m3, both round-to-nearest-even). Triton's interpreter (CI, CPU tensors) gets these
casts wrong (fp32 -> bf16 truncates; fp32 -> fp8 loses the carry of a mantissa that rounds up into
the exponent: 1.97 -> 1.0), so there the kernels round with exact integer arithmetic instead
(constexpr HW=False; it would also be correct on a GPU, but it made silu_mul_quant 1.5x slower on
an H100). The test file checks both paths against the reference: the interpreter in CI, the
hardware path when run on a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from qruntime.kernels.pdl import launch_options, wait_for_inputs

FP8 = torch.float8_e4m3fn
# the FP8 formats the kernels read and write: e4m3fn (nvidia-sm90) and e4m3fnuz (amd-gfx942, whose
# codes are e4m3fn's with the scales doubled: qruntime.target.to_e4m3fnuz)
FP8_FORMATS = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
FP8_MAX = 448.0
MIN_SCALE = 1e-12
MAX_BLOCK = 8192  # widest row kept in registers as one tile; longer rows loop over chunks of CHUNK
CHUNK = 4096
# the model dtypes the kernels compute in, as Triton's constexpr dtypes
TL_DTYPES = MappingProxyType({torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32})
_MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def row_config(width: int, max_block: int = MAX_BLOCK) -> tuple[int, int, int]:
    """(BLOCK, NUM_CHUNKS, num_warps) for a one-program-per-row kernel over `width` columns.

    One tile of next_power_of_2(width) when that is <= max_block, else chunks of min(CHUNK,
    max_block). num_warps gives each thread 8 to 16 elements of a tile (16-byte bf16 loads)."""
    if width <= 0:
        raise ValueError(f"row width must be positive, got {width}")
    if max_block < 16 or max_block & (max_block - 1):
        raise ValueError(f"max_block must be a power of two >= 16, got {max_block}")
    block = triton.next_power_of_2(width)
    if block > max_block:
        block = min(CHUNK, max_block)
    chunks = triton.cdiv(width, block)
    num_warps = max(1, min(16, block // 256))
    return block, chunks, num_warps


def check_model_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _MODEL_DTYPES:
        raise TypeError(f"{name} must be bf16, fp16 or fp32, got {t.dtype}")


def rows_of(name: str, t: torch.Tensor) -> torch.Tensor:
    """t as a 2D [rows, cols] tensor with unit column stride (a copy only when it has none)."""
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2D [tokens, cols], got shape {tuple(t.shape)}")
    return t if t.stride(1) == 1 else t.contiguous()


def fnuz_format(fp8: torch.dtype, what: str = "fp8") -> bool:
    """Whether `fp8` (one of FP8_FORMATS, else TypeError naming `what`) is e4m3fnuz: the kernels'
    FNUZ constexpr (False, e4m3fn, compiles to the code it always did)."""
    if fp8 not in FP8_FORMATS:
        raise TypeError(f"{what} must be float8_e4m3fn or float8_e4m3fnuz, got {fp8}")
    return fp8 == torch.float8_e4m3fnuz


def use_hw_casts(t: torch.Tensor) -> bool:
    """Whether kernels on `t` may use the hardware's fp32 -> bf16 / e4m3 conversions (compiled for
    a GPU) rather than the integer emulation that the interpreter needs (see the module doc)."""
    return t.device.type != "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1"


@triton.jit
def round_bf16(x):
    """fp32 -> nearest bf16 (ties to even) in integer arithmetic, returned as fp32. Finite inputs."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to(x, dtype: tl.constexpr, hw: tl.constexpr):
    """fp32 x rounded to `dtype` (the model dtype) as torch rounds each elementwise op; fp32 out."""
    if dtype == tl.bfloat16:
        if hw:
            return x.to(tl.bfloat16).to(tl.float32)  # cvt.rn
        else:
            return round_bf16(x)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)  # the interpreter's numpy cast rounds to even too
    else:
        return x


@triton.jit
def quant_scale(amax):
    """max(amax / 448, 1e-12) with IEEE division, as the reference computes it in fp32."""
    return tl.maximum(tl.math.div_rn(amax, 448.0), 1e-12)


@triton.jit
def fp8_e4m3_code(x, scale, inv_scale, HW: tl.constexpr, FNUZ: tl.constexpr = False):
    """Bytes (uint8) of fp8_e4m3fn(clamp(x / scale, -448, 448)), rounded to nearest even.

    FNUZ (the amd-gfx942 target, qruntime.target): e4m3fnuz codes of half that quotient (gfx942's own
    conversion on the GPU): e4m3fnuz(v / 2) has e4m3fn(v)'s bits for every v the clamp lets through,
    halving being exact, except e4m3fn's -0 (0x80, e4m3fnuz's NaN), which is 0; the caller stores
    the scale doubled (qruntime.target.to_e4m3fnuz of the e4m3fn codes and scale).

    inv_scale = div_rn(1, scale). x / scale is the correctly rounded quotient by Markstein's
    correction (q0 = x * inv_scale is within 1.5 ulp; one exact fma residual and one fma give the
    IEEE quotient) at three fp32 ops instead of a division per element (it equalled div_rn on all of
    2.7e8 random pairs on an H100); x = -0 keeps its sign."""
    q0 = x * inv_scale
    q = tl.fma(tl.fma(-q0, scale, x), inv_scale, q0)
    q = tl.where(x == 0.0, q0, q)
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if HW and FNUZ:
        return (q * 0.5).to(tl.float8e4b8).to(tl.uint8, bitcast=True)  # v_cvt_pk_fp8_f32 on gfx942
    elif HW:
        return q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)  # cvt.rn.satfinite.e4m3x2
    else:
        bits = q.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        # normal e4m3 (|q| >= 2^-6): round the fp32 mantissa to 3 bits (the carry may bump the
        # exponent), then rebias the exponent from 127 to 7: (127 - 7) << 3 = 960
        normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960
        # subnormal (|q| < 2^-6, steps of 2^-9; code 8 is the smallest normal): |q| * 512 rounded
        # to an integer by adding 2^23 in fp32 (exact product, one rounding to nearest even)
        sub = (mag.to(tl.float32, bitcast=True) * 512.0 + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000
        code = tl.where(mag < 0x3C800000, sub, normal) | sign
        if FNUZ:  # e4m3fn's -0 (x = -0, or a negative quotient that rounds to 0) is e4m3fnuz's NaN: 0
            code = tl.where(code == 0x80, 0, code)
        return code.to(tl.uint8)


@triton.jit
def fp8_values(codes, FNUZ: tl.constexpr):
    """uint8 codes as fp8 values: e4m3fn's, or with FNUZ e4m3fnuz's (half of e4m3fn's for the same
    code; the scale that goes with them is doubled)."""
    if FNUZ:
        return codes.to(tl.float8e4b8, bitcast=True)
    else:
        return codes.to(tl.float8e4nv, bitcast=True)


@triton.jit
def fp8_scale(scale, FNUZ: tl.constexpr):
    """The scale stored with (or applied to) codes made by fp8_e4m3_code: doubled with FNUZ."""
    if FNUZ:
        return scale * 2.0
    else:
        return scale


@triton.jit
def quantize_row(
    x_row, q_row, K, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, HW: tl.constexpr, FNUZ: tl.constexpr = False
):
    """One row's per-token FP8 quantization: K values at x_row -> e4m3 codes at q_row; returns the
    scale (amax / 448). NUM_CHUNKS > 1: the row in BLOCK-wide chunks, read twice (amax, then codes).
    FNUZ: the codes made as e4m3fnuz (fp8_e4m3_code), the same bytes; the scale is still e4m3fn's."""
    cols = tl.arange(0, BLOCK)
    if NUM_CHUNKS == 1:
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        scale = quant_scale(tl.max(tl.abs(x), axis=0))
        tl.store(q_row + cols, fp8_e4m3_code(x, scale, tl.math.div_rn(1.0, scale), HW, FNUZ), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + cols
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x))
        scale = quant_scale(tl.max(acc, axis=0))
        inv_scale = tl.math.div_rn(1.0, scale)
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < K
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + offs, fp8_e4m3_code(x, scale, inv_scale, HW, FNUZ), mask=mask)
    return scale


@triton.jit
def _dynamic_quant_kernel(
    x_ptr,  # [T, K] bf16 | fp16 | fp32, unit column stride
    q_ptr,  # [T, K] uint8 view of the fp8 output, contiguous
    s_ptr,  # [T] fp32
    K,
    stride_x,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    FNUZ: tl.constexpr = False,  # e4m3fnuz out (amd-gfx942): e4m3fn's bytes, the scale doubled
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    scale = quantize_row(x_ptr + row * stride_x, q_ptr + row * K, K, BLOCK, NUM_CHUNKS, HW, FNUZ)
    tl.store(s_ptr + row, fp8_scale(scale, FNUZ))


def dynamic_quant(
    x: torch.Tensor, *, max_block: int = MAX_BLOCK, pdl: bool = False, fp8: torch.dtype = FP8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 quantization: x [T, K] bf16 | fp16 | fp32 -> (xq [T, K] fp8 e4m3, xs [T, 1] fp32).

    Bit-identical to qruntime.ops.functional.dynamic_quant(x, 0). `max_block` (a power of two)
    caps the register tile; rows wider than it take the two-pass chunked path (tests force it).
    pdl: programmatic dependent launch (kernels/pdl.py). fp8 float8_e4m3fnuz (the amd-gfx942
    target): the same codes as e4m3fnuz and the scales doubled, qruntime.target.to_e4m3fnuz of
    the e4m3fn result, so xq * xs is the same."""
    check_model_dtype("x", x)
    fnuz = fnuz_format(fp8)
    x = rows_of("x", x)
    tokens, k = x.shape
    xq = torch.empty(tokens, k, dtype=fp8, device=x.device)
    xs = torch.empty(tokens, 1, dtype=torch.float32, device=x.device)
    if tokens == 0 or k == 0:
        xs.fill_(MIN_SCALE)
        return xq, xs
    block, chunks, num_warps = row_config(k, max_block)
    _dynamic_quant_kernel[(tokens,)](
        x,
        xq.view(torch.uint8),
        xs,
        k,
        x.stride(0),
        BLOCK=block,
        NUM_CHUNKS=chunks,
        HW=use_hw_casts(x),
        FNUZ=fnuz,
        num_warps=num_warps,
        **launch_options(pdl),
    )
    return xq, xs


@dataclass(frozen=True)
class DeferredQuant:
    """The DynamicQuant op's output left to its reader (ops/triton_ops.fold_dynamic_quant): one
    token's row x [1, K], which a PTPC GEMV quantizes as it reads it (fp8_gemm.ptpc_fp8_gemv_quant,
    the same codes and scale); `quantize()` is the dynamic_quant launch for any other reader, in
    the FP8 format `fp8` (the target's: qruntime.target)."""

    x: torch.Tensor
    pdl: bool = False
    fp8: torch.dtype = FP8

    def quantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return dynamic_quant(self.x, pdl=self.pdl, fp8=self.fp8)
