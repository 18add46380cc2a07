"""Tuning of the fused FP8 MoE kernel (kernels/fused_moe.py), a part of `qcompile tune`.

For every stacked-expert weight shape of the artifact that the fused kernel runs (PTPC FP8 weights
with per-token activations: scheme ptpc-fp8) and every token-count bucket: time the whole fused MoE
op over its candidate configs on random routing inputs and fresh random weights, check the winner
against the reference op (ops/moe.py), and return table entries under the key the runtime's MoE
op looks up (fused_moe.table_key). Needs a GPU; moe_shapes and table_entry run anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from qcompile.compile.manifest import rank_tensors
from qcompile.errors import QCompileError
from qcompile.quant import get_scheme

W13_SUFFIX = ".mlp.experts.w13.weight"
W2_SUFFIX = ".mlp.experts.w2.weight"
MIN_SQNR_DB = 30.0  # fused vs reference: bf16 rounding of the reference's adds is ~47 dB; a wrong kernel ~0


@dataclass(frozen=True)
class MoEShape:
    """One fused-MoE layer shape: w13 [E, 2I, H], w2 [E, H, I], top-k routing."""

    num_experts: int
    inter: int
    hidden: int
    top_k: int
    norm_topk_prob: bool

    @property
    def key(self) -> str:
        """The kernel-table key the runtime's MoE op looks up."""
        from qruntime.kernels.fused_moe import table_key

        return table_key(self.num_experts, 2 * self.inter, self.hidden, self.top_k)

    def expert_bytes(self) -> int:
        """FP8 weight bytes of one expert (w13 and w2), plus their bf16 per-row scales."""
        return 3 * self.inter * self.hidden + (2 * self.inter + self.hidden) * 2


def moe_shapes(manifest: dict[str, Any]) -> list[MoEShape]:
    """The distinct MoE layer shapes of an artifact whose experts the fused kernel runs: stacked
    `*.mlp.experts.w13` / `.w2` weights of a PTPC scheme with per-token activations, as one GPU
    holds them (a rank's slice at tp > 1). Raises QCompileError when a layer's w13 and w2 disagree
    or the manifest lacks the MoE spec."""
    tensors = rank_tensors(manifest)
    shapes = set()
    for name, info in tensors.items():
        if not name.endswith(W13_SUFFIX):
            continue
        scheme = get_scheme(info["scheme"])
        if scheme.linear_op != "PTPCLinear" or scheme.activation_group != 0:
            continue
        w2 = tensors.get(name[: -len(W13_SUFFIX)] + W2_SUFFIX)
        num_experts, inter2, hidden = info["shape"]
        if w2 is None or list(w2["shape"]) != [num_experts, hidden, inter2 // 2]:
            raise QCompileError(f"manifest: {name} {info['shape']} has no matching w2 [E, H, I] (got {w2})")
        moe = (manifest.get("spec") or {}).get("moe")
        if not moe:
            raise QCompileError(f"manifest: {name} is a stacked MoE weight but spec.moe is missing")
        shapes.add(
            MoEShape(num_experts, inter2 // 2, hidden, int(moe["num_experts_per_tok"]), bool(moe["norm_topk_prob"]))
        )
    return sorted(shapes, key=lambda s: (s.num_experts, s.inter, s.hidden, s.top_k))


def table_entry(config_dict: dict[str, int], us: float, default_us: float, sqnr_db: float) -> dict[str, Any]:
    """The kernels/<device>.json record of one bucket: the config, its µs, the default's µs and
    the winner's SQNR against the reference op."""
    return {**config_dict, "us": round(us, 2), "default_us": round(default_us, 2), "sqnr_db": round(sqnr_db, 1)}


def _random_experts(shape: MoEShape, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Fresh random PTPC experts: (w13, w13_scale, w2, w2_scale) with weights spread over e4m3."""
    e, i, h = shape.num_experts, shape.inter, shape.hidden
    w13 = (torch.randn(e, 2 * i, h, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    w2 = (torch.randn(e, h, i, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s13 = (torch.rand(e, 2 * i, 1, device=device) * 2e-4 + 1e-4).to(torch.bfloat16)
    s2 = (torch.rand(e, h, 1, device=device) * 2e-4 + 1e-4).to(torch.bfloat16)
    return w13, s13, w2, s2


def tune_moe(
    shape: MoEShape,
    buckets: Iterable[int],
    device: torch.device,
    time_us: Callable[[list[Callable[[], Any]]], float],
    rotate_bytes: int,
) -> dict[str, dict[str, Any]]:
    """bucket -> the fastest fused-MoE config at that many tokens, with its µs (`time_us` times a
    list of calls back to back, each on its own weight copy: tune._time_us)."""
    import torch.nn.functional as F
    from qruntime.benchmark import sqnr_db
    from qruntime.kernels.fused_moe import default_config, fused_moe, sweep_configs
    from qruntime.ops.base import OpEnv
    from qruntime.ops.moe import MoE
    from triton.runtime.errors import OutOfResources

    e, i, h, k = shape.num_experts, shape.inter, shape.hidden, shape.top_k
    copies = [_random_experts(shape, device) for _ in range(max(2, -(-rotate_bytes // (e * shape.expert_bytes()))))]
    router_w = torch.randn(e, h, device=device, dtype=torch.bfloat16) * 0.05
    attrs = {"num_experts": e, "top_k": k, "norm_topk_prob": shape.norm_topk_prob, "linear": "PTPCLinear"}
    reference = MoE({**attrs, "group_size": 0}, OpEnv(torch.bfloat16, device, None))
    table: dict[str, dict[str, Any]] = {}
    for tokens in buckets:
        x = torch.randn(tokens, h, device=device, dtype=torch.bfloat16)
        logits = F.linear(x, router_w)

        def run(config, weights, x=x, logits=logits):
            return fused_moe(x, logits, *weights, k, shape.norm_topk_prob, config)

        timed = []
        for config in sweep_configs(tokens, e, i, h, k):
            try:
                us = time_us([lambda c=c, config=config: run(config, c) for c in copies])
            except OutOfResources:  # e.g. a pipeline deeper than shared memory holds: not a candidate here
                continue
            timed.append((us, config))
        if not timed:
            raise QCompileError(f"no fused-MoE config runs for {shape.key} at {tokens} tokens")
        best_us, best = min(timed, key=lambda t: t[0])
        default = default_config(tokens, e, i, h, k)
        default_us = next((us for us, c in timed if c == default), float("nan"))
        sqnr = sqnr_db(reference(None, x, router_w, *copies[0]), run(best, copies[0]))
        if not sqnr >= MIN_SQNR_DB:
            raise QCompileError(f"tuned MoE {shape.key} at {tokens} tokens ({best}) is wrong: SQNR {sqnr:.1f} dB")
        table[str(tokens)] = table_entry(best.to_dict(), best_us, default_us, sqnr)
    return table
