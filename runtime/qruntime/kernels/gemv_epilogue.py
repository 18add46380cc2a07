"""SiLU-mul + per-token FP8 quantization of a one-token gate_up row, run by the last program of the
gate_up GEMV that made the row (fp8_gemm.ptpc_fp8_gemv_silu_quant) instead of in a launch of its own.

Each GEMV program stores its columns of gate_up [1, 2I] (model dtype, as always), then counts itself
in on an int32 counter (a barrier first, then an acq_rel atomic at GPU scope, so its stores are
visible to whoever counts last); the program that counts last puts the counter back to zero (a
captured CUDA graph replays the launch) and computes silu_mul_quant.py's row from the stored
gate_up, op for op (activation.silu_times, shared with that kernel): yq [1, I] e4m3
codes and ys [1] fp32, bit for bit. At one token the SiLU-mul-quant kernel is a single program
anyway; here it runs as that launch's tail, saving the launch and the gap before it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from qruntime.kernels.activation import silu_times
from qruntime.kernels.dynamic_quant import fp8_e4m3_code, fp8_scale, quant_scale


@triton.jit
def _row_value(gu_ptr, offs, mask, inter, DTYPE: tl.constexpr, HW: tl.constexpr):
    g = tl.load(gu_ptr + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
    u = tl.load(gu_ptr + inter + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
    return silu_times(g, u, DTYPE, HW)


@triton.jit
def last_program_silu_quant(
    gu_ptr, q_ptr, s_ptr, counter_ptr, inter, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    DTYPE: tl.constexpr, HW: tl.constexpr, FNUZ: tl.constexpr,
):  # fmt: skip
    """Called by every program after storing its part of gate_up [2 * inter] at gu_ptr: the one that
    finishes last writes silu_mul_quant's yq [inter] (uint8 codes at q_ptr) and ys (at s_ptr)."""
    tl.debug_barrier()  # this program's stores, before its release
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.store(counter_ptr, 0)  # for the next launch (a captured graph replays this one)
        cols = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + cols
            amax = tl.maximum(amax, tl.abs(_row_value(gu_ptr, offs, offs < inter, inter, DTYPE, HW)))
        scale = quant_scale(tl.max(amax, axis=0))
        inv_scale = tl.math.div_rn(1.0, scale)
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < inter
            y = _row_value(gu_ptr, offs, mask, inter, DTYPE, HW)
            tl.store(q_ptr + offs, fp8_e4m3_code(y, scale, inv_scale, HW, FNUZ), mask=mask)
        tl.store(s_ptr, fp8_scale(scale, FNUZ))
