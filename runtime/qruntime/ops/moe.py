"""Mixture-of-experts: routing, the per-expert coefficient of the unfused form, and the fused MoE op."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qruntime.ops import functional as fn
from qruntime.ops.base import Op, OpBindError
from qruntime.ops.quant import check_zero_point

LINEARS = ("Gemm", "PTPCLinear", "BlockFP8Linear", "W4A16Linear")
UNQUANTIZED_INPUT = ("Gemm", "W4A16Linear")  # the linears that read activations in the model dtype


class MoERouting(Op):
    attrs = ("top_k", "norm_topk_prob")

    def __call__(self, step, logits):
        return fn.moe_routing(logits, self.a["top_k"], bool(self.a["norm_topk_prob"]))


class ExpertWeight(Op):
    """The weight token t gives expert `expert` ([T, 1]; 0 where it is not routed there)."""

    attrs = ("expert",)

    def __call__(self, step, weights, ids):
        return (weights * (ids == self.a["expert"])).sum(-1, keepdim=True)


class MoE(Op):
    """Router, top-k routing, then each routed expert on its tokens only (gathered), weighted and
    accumulated from zero in expert order in the model dtype — what the unfused form computes,
    without running an expert on tokens that give it weight 0.

    Activations are quantized twice per step: x once for every up projection, then the SiLU-mul
    outputs of every routed (token, expert) pair together for the down projections. Per token or
    per group that is what each expert quantizing its own rows gives; per tensor (group_size -1) it
    is vLLM's fused MoE: one scale over x, one over all routed pairs' activations — where the
    unfused form (every expert on every token) takes each expert's over all T tokens instead, so
    the two agree only up to that FP8 rounding."""

    attrs = ("num_experts", "top_k", "norm_topk_prob", "linear", "group_size")
    capturable = False  # which experts run depends on the routing, read back to the host
    optional_attrs = {"block_n": 128, "block_k": 128}

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        if self.a["linear"] not in LINEARS:
            raise OpBindError(f"MoE linear {self.a['linear']!r} is not one of {LINEARS}")
        consts = tuple(consts) + (None,) * (8 - len(consts))
        if (consts[6] is not None or consts[7] is not None) and self.a["linear"] != "W4A16Linear":
            raise OpBindError(f"zero points are read by linear W4A16Linear only, not {self.a['linear']!r}")
        check_zero_point(consts[6], consts[3], "w13_zero_point")
        check_zero_point(consts[7], consts[5], "w2_zero_point")

    def _quant(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(xq, xs) for an FP8 linear, (x, None) for Gemm and W4A16Linear (weight-only)."""
        if self.a["linear"] in UNQUANTIZED_INPUT:
            return x, None
        return fn.dynamic_quant(x, self.a["group_size"])

    def _linear(
        self,
        xq: torch.Tensor,
        xs: torch.Tensor | None,
        w: torch.Tensor,
        ws: torch.Tensor | None,
        wz: torch.Tensor | None = None,
    ):
        a = self.a
        if a["linear"] == "W4A16Linear":  # group_size is the weight's int4 groups here
            return fn.w4a16_linear(xq, w, ws, a["group_size"], wz)
        if xs is None:
            return F.linear(xq, w)
        if a["linear"] == "PTPCLinear":
            return fn.ptpc_linear(xq, xs, w, ws, self.env.dtype)
        return fn.block_fp8_linear(xq, xs, w, ws, a["block_n"], a["block_k"], self.env.dtype)

    def __call__(self, step, x, router_w, w13, w13_scale, w2, w2_scale, w13_zp=None, w2_zp=None):
        weights, ids = fn.moe_routing(F.linear(x, router_w), self.a["top_k"], bool(self.a["norm_topk_prob"]))
        xq, xs = self._quant(x)
        routes, acts = [], []
        for e in ids.unique().tolist():  # ascending: expert order
            tokens, slot = torch.where(ids == e)
            scale = None if w13_scale is None else w13_scale[e]
            zp = None if w13_zp is None else w13_zp[e]
            h = self._linear(xq[tokens], None if xs is None else xs[tokens], w13[e], scale, zp)  # [t, 2I]
            routes.append((e, tokens, slot))
            acts.append(fn.silu_mul(h))  # [t, I]
        out = torch.zeros_like(x)  # [T, H]
        if not routes:
            return out
        aq, as_ = self._quant(torch.cat(acts))  # [routed pairs, I]
        start = 0
        for (e, tokens, slot), act in zip(routes, acts, strict=True):
            rows = slice(start, start + act.shape[0])
            start = rows.stop
            scale = None if w2_scale is None else w2_scale[e]
            zp = None if w2_zp is None else w2_zp[e]
            down = self._linear(aq[rows], None if as_ is None else as_[rows], w2[e], scale, zp)  # [t, H]
            out.index_add_(0, tokens, down * weights[tokens, slot, None])
        return out
