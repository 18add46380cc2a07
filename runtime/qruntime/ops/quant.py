"""FP8 linears, dynamic activation quantization, and the norm / activation ops fused with it."""

from __future__ import annotations

from qruntime.ops import functional as fn
from qruntime.ops.base import Op


class DynamicQuant(Op):
    attrs = ("group_size",)

    def __call__(self, step, x):
        return fn.dynamic_quant(x, self.a["group_size"])


class PTPCLinear(Op):
    """Per-token activation scale x per-channel weight scale, FP8 operands, fp32 accumulation."""

    def __call__(self, step, xq, xs, w, ws):
        return fn.ptpc_linear(xq, xs, w, ws, self.env.dtype)


class BlockFP8Linear(Op):
    attrs = ("block_n", "block_k")

    def __call__(self, step, xq, xs, w, ws):
        return fn.block_fp8_linear(xq, xs, w, ws, self.a["block_n"], self.a["block_k"], self.env.dtype)


class AddRMSNorm(Op):
    """residual_out = x + residual (x when there is none); y = RMSNorm(residual_out)."""

    attrs = ("epsilon",)

    def __call__(self, step, x, residual, w):
        out = x if residual is None else x + residual
        return fn.rms_norm(out, w, self.a["epsilon"]), out


class AddRMSNormQuant(Op):
    attrs = ("epsilon", "group_size")

    def __call__(self, step, x, residual, w):
        out = x if residual is None else x + residual
        yq, ys = fn.dynamic_quant(fn.rms_norm(out, w, self.a["epsilon"]), self.a["group_size"])
        return yq, ys, out


class SiluMul(Op):
    def __call__(self, step, gate_up):
        return fn.silu_mul(gate_up)


class SiluMulQuant(Op):
    attrs = ("group_size",)

    def __call__(self, step, gate_up):
        return fn.dynamic_quant(fn.silu_mul(gate_up), self.a["group_size"])
