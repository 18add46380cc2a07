"""The SiLU-mul's arithmetic, shared by every kernel that computes it (silu_mul_quant.py, the fused
MoE's GEMMs and GEMVs), so they agree bit for bit."""

from __future__ import annotations

import triton
import triton.language as tl

from qruntime.kernels.dynamic_quant import round_to


@triton.jit
def silu_times(g, u, DTYPE: tl.constexpr, HW: tl.constexpr):
    """D(D(g * D(sigmoid(g))) * u) in fp32: functional.silu_mul's op-by-op roundings to the model dtype D."""
    sg = round_to(1.0 / (1.0 + tl.exp(-g)), DTYPE, HW)
    return round_to(round_to(g * sg, DTYPE, HW) * u, DTYPE, HW)
