"""SiLU-and-multiply followed by per-token FP8 quantization (the `SiluMulQuant` op, group_size 0).

Reference: qruntime.ops.functional.silu_mul then dynamic_quant(y, 0). gate_up [T, 2I] holds the
gate in columns [0, I) and up in [I, 2I); torch evaluates `gate * sigmoid(gate) * up` in the model
dtype D, one op at a time, each computed in fp32 and rounded to D:
    sg = D(1 / (1 + exp(-gate))),  t = D(gate * sg),  y = D(t * up)
The kernel follows exactly these steps. The two products are exact in fp32 before their rounding
(bf16 x bf16), so they match torch bit for bit given the same sg; sg itself comes from an fp32
exp whose last bit may differ from torch's (Triton's exp on the GPU is exp2-based), which moves
sg by one bf16 ulp in a few elements per million, so y is within 1 bf16 ulp of torch's
intermediate and bit-identical almost everywhere. Then, as the reference, in fp32:
    ys = max(amax|y| / 448, 1e-12),  yq = fp8(clamp(y / ys, ±448))  (IEEE division, exact e4m3 RNE)

One program per token row, over chunks of BLOCK = min(next_power_of_2(I), 4096) columns. Up to
four chunks (I <= 16384: Qwen3-8B's I = 12288 is three) are held in registers as separate tiles,
so the row is read and computed once with no masked padding (a single power-of-two tile of 16384
would waste a quarter of the exp/sigmoid work, and this kernel is near the issue-rate limit:
at T = 4096 on an H100: 112 us, against 135 for one 16384 tile and 122 for two passes over
4096-wide chunks).
Wider rows take two passes: amax, then recompute y (gate_up again, mostly from L2) and quantize.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qruntime.kernels.activation import silu_times
from qruntime.kernels.dynamic_quant import (
    CHUNK,
    FP8,
    TL_DTYPES,
    check_model_dtype,
    fnuz_format,
    fp8_e4m3_code,
    fp8_scale,
    quant_scale,
    row_config,
    rows_of,
    use_hw_casts,
)
from qruntime.kernels.fp8_gemm import SplitKPartials, splitk_value
from qruntime.kernels.pdl import launch_options, wait_for_inputs

MAX_REG_CHUNKS = tl.constexpr(4)  # chunks of y a program keeps in registers (one pass); beyond: two passes


@triton.jit
def _silu_mul(
    g_row, offs, mask, inter, xs_ptr, ws_ptr, row, T, stride_xs, stride_ws,
    SPLIT: tl.constexpr, DTYPE: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """D(D(gate * D(sigmoid(gate))) * up) of one chunk, in fp32; 0 past inter. SPLIT > 0: gate_up is
    read from the split-K GEMM's partials at g_row (their base then), reduced here with its scales."""
    if SPLIT == 0:
        g = tl.load(g_row + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(g_row + inter + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        width = 2 * inter
        g = splitk_value(g_row, xs_ptr, ws_ptr, row, offs, mask, T, width, stride_xs, stride_ws, SPLIT, DTYPE, HW)
        u = splitk_value(
            g_row, xs_ptr, ws_ptr, row, inter + offs, mask, T, width, stride_xs, stride_ws, SPLIT, DTYPE, HW
        )
    return silu_times(g, u, DTYPE, HW)


@triton.jit
def _quant_store(q_row, offs, mask, y, scale, inv_scale, HW: tl.constexpr, FNUZ: tl.constexpr):
    tl.store(q_row + offs, fp8_e4m3_code(y, scale, inv_scale, HW, FNUZ), mask=mask)


@triton.jit
def _silu_mul_quant_kernel(
    gu_ptr,  # [T, 2I] model dtype, unit column stride; SPLIT: a split-K GEMM's fp32 partials [SPLIT, T, 2I]
    q_ptr,  # [T, I] uint8 view of the fp8 output, contiguous
    s_ptr,  # [T] fp32
    xs_ptr,  # SPLIT: the GEMM's scales xs [T, 1] and ws [2I, 1]
    ws_ptr,
    T,
    stride_xs,
    stride_ws,
    inter,
    stride_gu,
    SPLIT: tl.constexpr,  # 0: gu_ptr is gate_up itself
    DTYPE: tl.constexpr,  # the model dtype
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    FNUZ: tl.constexpr = False,  # e4m3fnuz codes (amd-gfx942), the scales doubled
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    g_row = gu_ptr + row * stride_gu  # stride_gu 0 with SPLIT: the partials' base
    q_row = q_ptr + row * inter
    c0 = tl.arange(0, BLOCK)
    if NUM_CHUNKS <= MAX_REG_CHUNKS:
        # one pass: up to four chunks of y stay in registers (unrolled: a tile list cannot loop)
        c1 = c0 + BLOCK
        c2 = c1 + BLOCK
        c3 = c2 + BLOCK
        y0 = _silu_mul(g_row, c0, c0 < inter, inter, xs_ptr, ws_ptr, row, T, stride_xs, stride_ws, SPLIT, DTYPE, HW)
        amax = tl.max(tl.abs(y0), axis=0)
        if NUM_CHUNKS > 1:
            y1 = _silu_mul(g_row, c1, c1 < inter, inter, xs_ptr, ws_ptr, row, T, stride_xs, stride_ws, SPLIT, DTYPE, HW)
            amax = tl.maximum(amax, tl.max(tl.abs(y1), axis=0))
        if NUM_CHUNKS > 2:
            y2 = _silu_mul(g_row, c2, c2 < inter, inter, xs_ptr, ws_ptr, row, T, stride_xs, stride_ws, SPLIT, DTYPE, HW)
            amax = tl.maximum(amax, tl.max(tl.abs(y2), axis=0))
        if NUM_CHUNKS > 3:
            y3 = _silu_mul(g_row, c3, c3 < inter, inter, xs_ptr, ws_ptr, row, T, stride_xs, stride_ws, SPLIT, DTYPE, HW)
            amax = tl.maximum(amax, tl.max(tl.abs(y3), axis=0))
        scale = quant_scale(amax)
        inv_scale = tl.math.div_rn(1.0, scale)
        _quant_store(q_row, c0, c0 < inter, y0, scale, inv_scale, HW, FNUZ)
        if NUM_CHUNKS > 1:
            _quant_store(q_row, c1, c1 < inter, y1, scale, inv_scale, HW, FNUZ)
        if NUM_CHUNKS > 2:
            _quant_store(q_row, c2, c2 < inter, y2, scale, inv_scale, HW, FNUZ)
        if NUM_CHUNKS > 3:
            _quant_store(q_row, c3, c3 < inter, y3, scale, inv_scale, HW, FNUZ)
    else:
        # two passes: amax, then recompute y (gate_up again, mostly from L2) and quantize
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + c0
            acc = tl.maximum(
                acc,
                tl.abs(
                    _silu_mul(
                        g_row, offs, offs < inter, inter, xs_ptr, ws_ptr, row, T, stride_xs, stride_ws, SPLIT, DTYPE, HW
                    )
                ),
            )
        scale = quant_scale(tl.max(acc, axis=0))
        inv_scale = tl.math.div_rn(1.0, scale)
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + c0
            mask = offs < inter
            _quant_store(
                q_row,
                offs,
                mask,
                _silu_mul(g_row, offs, mask, inter, xs_ptr, ws_ptr, row, T, stride_xs, stride_ws, SPLIT, DTYPE, HW),
                scale,
                inv_scale,
                HW,
                FNUZ,
            )
    tl.store(s_ptr + row, fp8_scale(scale, FNUZ))


@triton.jit
def _silu_mul_kernel(
    gu_ptr,  # [T, 2I] model dtype, unit column stride
    y_ptr,  # [T, I] model dtype, contiguous
    inter,
    stride_gu,
    DTYPE: tl.constexpr,  # the model dtype
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    g_row = gu_ptr + row * stride_gu
    c0 = tl.arange(0, BLOCK)
    for c in range(NUM_CHUNKS):
        offs = c * BLOCK + c0
        mask = offs < inter
        y = _silu_mul(g_row, offs, mask, inter, gu_ptr, gu_ptr, row, 0, 0, 0, 0, DTYPE, HW)
        tl.store(y_ptr + row * inter + offs, y.to(DTYPE), mask=mask)


def _token_rows(shape: tuple[int, int]) -> tuple[int, int]:
    """(T, I) of gate_up [T, 2I]; ValueError for an odd width."""
    tokens, width = shape
    if width % 2:
        raise ValueError(f"gate_up must have an even number of columns [T, 2I], got {width}")
    return tokens, width // 2


def silu_config(inter: int, max_block: int = CHUNK) -> tuple[int, int, int]:
    """(BLOCK, NUM_CHUNKS, num_warps): chunks of min(next_power_of_2(I), max_block) columns."""
    block, _, num_warps = row_config(min(inter, max_block), max_block)
    return block, triton.cdiv(inter, block), num_warps


def silu_mul_quant(
    gate_up: torch.Tensor, *, max_block: int = CHUNK, pdl: bool = False, fp8: torch.dtype = FP8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused SiLU-mul and per-token FP8 quantization.

    gate_up [T, 2I] bf16 | fp16 | fp32 (gate columns then up columns) -> (yq [T, I] fp8 e4m3,
    ys [T, 1] fp32), i.e. qruntime.ops.functional.dynamic_quant(silu_mul(gate_up), 0).
    `max_block` (a power of two) is the chunk width: I up to 4 chunks is done in one pass from
    registers, wider rows in two passes (tests force both at small I). pdl: programmatic dependent
    launch (kernels/pdl.py). gate_up may be a split-K GEMM's SplitKPartials (fp8_gemm.py), reduced
    in this launch. fp8 float8_e4m3fnuz (amd-gfx942): yq as e4m3fnuz with ys doubled (dynamic_quant's fp8)."""
    fnuz = fnuz_format(fp8)
    split = isinstance(gate_up, SplitKPartials)
    if not split:
        check_model_dtype("gate_up", gate_up)
        gate_up = rows_of("gate_up", gate_up)
    elif gate_up.dtype not in TL_DTYPES:
        raise ValueError(f"gate_up's partials would give {gate_up.dtype}, not a model dtype")
    tokens, inter = _token_rows(gate_up.shape)
    yq = torch.empty(tokens, inter, dtype=fp8, device=gate_up.device)
    ys = torch.empty(tokens, 1, dtype=torch.float32, device=gate_up.device)
    if tokens == 0:
        return yq, ys
    block, chunks, num_warps = silu_config(inter, max_block)
    part, xs, ws, _, stride_xs, stride_ws = gate_up.kernel_args() if split else (gate_up, ys, ys, tokens, 0, 0)
    _silu_mul_quant_kernel[(tokens,)](
        part,
        yq.view(torch.uint8),
        ys,
        xs,
        ws,
        tokens,
        stride_xs,
        stride_ws,
        inter,
        0 if split else gate_up.stride(0),
        SPLIT=gate_up.split if split else 0,
        DTYPE=TL_DTYPES[gate_up.dtype],
        BLOCK=block,
        NUM_CHUNKS=chunks,
        HW=use_hw_casts(part),
        FNUZ=fnuz,
        num_warps=num_warps,
        **launch_options(pdl),
    )
    return yq, ys


def silu_mul(gate_up: torch.Tensor, *, max_block: int = CHUNK, pdl: bool = False) -> torch.Tensor:
    """Fused SiLU-mul, unquantized (the `SiluMul` op: a weight-only recipe's MLP, whose down
    projection reads model-dtype activations): gate_up [T, 2I] bf16 | fp16 | fp32 -> y [T, I] in its
    dtype, qruntime.ops.functional.silu_mul rounded as torch rounds it, op by op. One program per
    row, over chunks of `max_block` columns; pdl: programmatic dependent launch (kernels/pdl.py)."""
    if isinstance(gate_up, SplitKPartials):
        gate_up = gate_up.reduce()
    check_model_dtype("gate_up", gate_up)
    gate_up = rows_of("gate_up", gate_up)
    tokens, inter = _token_rows(gate_up.shape)
    y = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0:
        return y
    block, chunks, num_warps = silu_config(inter, max_block)
    _silu_mul_kernel[(tokens,)](
        gate_up,
        y,
        inter,
        gate_up.stride(0),
        DTYPE=TL_DTYPES[gate_up.dtype],
        BLOCK=block,
        NUM_CHUNKS=chunks,
        HW=use_hw_casts(gate_up),
        num_warps=num_warps,
        **launch_options(pdl),
    )
    return y
