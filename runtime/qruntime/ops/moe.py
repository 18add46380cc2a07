"""Mixture-of-experts: routing, the per-expert coefficient of the unfused form, and the fused MoE op."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qruntime.ops import functional as fn
from qruntime.ops.base import Op, OpBindError

LINEARS = ("Gemm", "PTPCLinear", "BlockFP8Linear")


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
    without running an expert on tokens that give it weight 0."""

    attrs = ("num_experts", "top_k", "norm_topk_prob", "linear", "group_size")
    capturable = False  # which experts run depends on the routing, read back to the host
    optional_attrs = {"block_n": 128, "block_k": 128}

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        if self.a["linear"] not in LINEARS:
            raise OpBindError(f"MoE linear {self.a['linear']!r} is not one of {LINEARS}")

    def _linear(self, x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor | None) -> torch.Tensor:
        a = self.a
        if a["linear"] == "Gemm":
            return F.linear(x, w)
        xq, xs = fn.dynamic_quant(x, a["group_size"])
        if a["linear"] == "PTPCLinear":
            return fn.ptpc_linear(xq, xs, w, ws, self.env.dtype)
        return fn.block_fp8_linear(xq, xs, w, ws, a["block_n"], a["block_k"], self.env.dtype)

    def __call__(self, step, x, router_w, w13, w13_scale, w2, w2_scale):
        weights, ids = fn.moe_routing(F.linear(x, router_w), self.a["top_k"], bool(self.a["norm_topk_prob"]))
        out = torch.zeros_like(x)  # [T, H]
        for e in ids.unique().tolist():  # ascending: expert order
            tokens, slot = torch.where(ids == e)
            h = self._linear(x[tokens], w13[e], None if w13_scale is None else w13_scale[e])  # [t, 2I]
            down = self._linear(fn.silu_mul(h), w2[e], None if w2_scale is None else w2_scale[e])  # [t, H]
            out.index_add_(0, tokens, down * weights[tokens, slot, None])
        return out
