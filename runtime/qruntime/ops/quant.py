"""Quantized linears (FP8, int4 weight-only), dynamic activation quantization, and the norm /
activation ops fused with it."""

from __future__ import annotations

import torch

from qruntime.ops import functional as fn
from qruntime.ops.base import Op, OpBindError


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


class W4A16Linear(Op):
    """int4 weights packed 8 to an int32 along K with one scale (and, optionally, one zero-point code
    wz) per row and `group_size` columns; activations in the model dtype: y = x · dequant(w)ᵀ."""

    attrs = ("group_size",)

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        group = self.a["group_size"]
        if group <= 0 or group % 8:
            raise OpBindError(f"group_size {group} is not a positive multiple of 8 (int4 values per int32)")
        w, ws, wz = (consts + (None, None, None, None))[1:4]
        if w is not None and ws is not None:
            if w.dtype != torch.int32 or w.dim() != 2 or ws.dim() != 2:
                raise OpBindError(
                    f"w must be int32 [N, K/8] and ws [N, K/group_size], got {w.dtype} "
                    f"{list(w.shape)} and {list(ws.shape)}"
                )
            if ws.shape[0] != w.shape[0] or ws.shape[1] * group != w.shape[1] * 8:
                raise OpBindError(
                    f"w {list(w.shape)} (K = {w.shape[1] * 8}) and ws {list(ws.shape)} do not fit group_size {group}"
                )
            check_zero_point(wz, ws, "wz")

    def __call__(self, step, x, w, ws, wz=None):
        return fn.w4a16_linear(x, w, ws, self.a["group_size"], wz)


def check_zero_point(wz: torch.Tensor | None, ws: torch.Tensor | None, what: str) -> None:
    """OpBindError unless the zero points `wz` (when given) are uint8 shaped like their scales `ws`."""
    if wz is None or ws is None:
        return
    if wz.dtype != torch.uint8 or tuple(wz.shape) != tuple(ws.shape):
        raise OpBindError(
            f"{what} (zero points) must be uint8 shaped like the scales {list(ws.shape)}, got {wz.dtype} "
            f"{list(wz.shape)}"
        )


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
