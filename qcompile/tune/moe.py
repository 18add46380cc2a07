"""Tuning of the fused MoE kernels, a part of `qcompile tune`: kernels/fused_moe.py for PTPC FP8
experts (scheme ptpc-fp8), kernels/fused_moe_w4a16.py for packed int4 ones (w4a16, w4a16-zp).

For every stacked-expert weight shape of the artifact that a fused kernel runs and every
token-count bucket: time the whole fused MoE op over its candidate configs on random routing inputs
and fresh random weights, check the winner against the reference op (ops/moe.py), and return table
entries under the key the runtime's MoE op looks up (fused_moe.table_key, or
fused_moe_w4a16.table_key: the int4 group and zero points in it). Needs a GPU for real timings;
moe_shapes and table_entry run anywhere, the loop too (Triton's interpreter on CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from qcompile.compile.manifest import rank_tensors
from qcompile.errors import QCompileError
from qcompile.quant import get_scheme

W13_SUFFIX = ".mlp.experts.w13.weight"  # `.weight_packed` for int4 (the scheme's weight_key)
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
    group_size: int = 0  # int4 experts (W4A16Linear): columns per scale; 0: PTPC FP8 experts
    zero_point: bool = False  # int4 experts with a uint8 zero point per group

    @property
    def key(self) -> str:
        """The kernel-table key the runtime's MoE op looks up."""
        from qruntime.kernels import fused_moe, fused_moe_w4a16

        inter2 = 2 * self.inter
        if self.group_size:
            return fused_moe_w4a16.table_key(
                self.num_experts, inter2, self.hidden, self.top_k, self.group_size, self.zero_point
            )
        return fused_moe.table_key(self.num_experts, inter2, self.hidden, self.top_k)

    def expert_bytes(self) -> int:
        """Weight bytes of one expert (w13 and w2): FP8 plus bf16 per-row scales, or int4 plus bf16
        group scales (and uint8 zero points)."""
        weights = 3 * self.inter * self.hidden
        if not self.group_size:
            return weights + (2 * self.inter + self.hidden) * 2
        return weights // 2 + weights // self.group_size * (3 if self.zero_point else 2)


def moe_shapes(manifest: dict[str, Any]) -> list[MoEShape]:
    """The distinct MoE layer shapes of an artifact whose experts a fused kernel runs: stacked
    `*.mlp.experts.w13` / `.w2` weights of a PTPC scheme with per-token activations, or of a packed
    int4 scheme (`.weight_packed` [E, 2I, H/8]: H is 8 columns a word), as one GPU holds them (a
    rank's slice at tp > 1). Raises QCompileError when a layer's w13 and w2 disagree or the manifest
    lacks the MoE spec."""
    tensors = rank_tensors(manifest)
    shapes = set()
    for name, info in tensors.items():
        scheme = get_scheme(info["scheme"])
        suffix = W13_SUFFIX + ("_packed" if scheme.int4 else "")
        if not name.endswith(suffix):
            continue
        if scheme.int4 is None and (scheme.linear_op != "PTPCLinear" or scheme.activation_group != 0):
            continue
        per_word = 8 if scheme.int4 else 1
        w2 = tensors.get(name[: -len(suffix)] + W2_SUFFIX + suffix[len(W13_SUFFIX) :])
        num_experts, inter2, cols = info["shape"]
        hidden = cols * per_word
        if w2 is None or list(w2["shape"]) != [num_experts, hidden, inter2 // 2 // per_word]:
            raise QCompileError(
                f"manifest: {name} {info['shape']} has no matching w2 [E, H, I{'/8' if per_word > 1 else ''}] (got {w2})"
            )
        moe = (manifest.get("spec") or {}).get("moe")
        if not moe:
            raise QCompileError(f"manifest: {name} is a stacked MoE weight but spec.moe is missing")
        int4 = {"group_size": scheme.int4.group_size, "zero_point": scheme.zero_point} if scheme.int4 else {}
        shapes.add(
            MoEShape(
                num_experts,
                inter2 // 2,
                hidden,
                int(moe["num_experts_per_tok"]),
                bool(moe["norm_topk_prob"]),
                **int4,
            )
        )
    return sorted(shapes, key=lambda s: (s.group_size, s.zero_point, s.num_experts, s.inter, s.hidden, s.top_k))


def table_entry(config_dict: dict[str, int], us: float, default_us: float, sqnr_db: float) -> dict[str, Any]:
    """The kernels/<device>.json record of one bucket: the config, its µs, the default's µs and
    the winner's SQNR against the reference op."""
    return {**config_dict, "us": round(us, 2), "default_us": round(default_us, 2), "sqnr_db": round(sqnr_db, 1)}


def _random_experts(shape: MoEShape, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Fresh random PTPC experts: (w13, w13_scale, w2, w2_scale) with weights spread over e4m3; int4
    ones (any int32 bits are valid codes) with bf16 group scales, and zero points last when the
    shape has them."""
    e, i, h = shape.num_experts, shape.inter, shape.hidden
    if shape.group_size:
        out = []
        for rows, cols in ((2 * i, h), (h, i)):
            out.append(torch.randint(-(1 << 31), 1 << 31, (e, rows, cols // 8), device=device, dtype=torch.int32))
            out.append((torch.rand(e, rows, cols // shape.group_size, device=device) * 0.01 + 0.005).to(torch.bfloat16))
        zps = [
            torch.randint(0, 16, w.shape[:2] + s.shape[2:], device=device, dtype=torch.uint8)
            for w, s in (out[:2], out[2:])
        ]
        return (*out, *zps) if shape.zero_point else tuple(out)
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
    from qruntime.kernels import fused_moe, fused_moe_w4a16
    from qruntime.ops.base import OpEnv
    from qruntime.ops.moe import MoE
    from triton.runtime.errors import OutOfResources

    e, i, h, k = shape.num_experts, shape.inter, shape.hidden, shape.top_k
    copies = [_random_experts(shape, device) for _ in range(max(2, -(-rotate_bytes // (e * shape.expert_bytes()))))]
    router_w = torch.randn(e, h, device=device, dtype=torch.bfloat16) * 0.05
    linear = "W4A16Linear" if shape.group_size else "PTPCLinear"
    attrs = {"num_experts": e, "top_k": k, "norm_topk_prob": shape.norm_topk_prob, "linear": linear}
    reference = MoE({**attrs, "group_size": shape.group_size}, OpEnv(torch.bfloat16, device, None))
    kernels = fused_moe_w4a16 if shape.group_size else fused_moe
    default_config, sweep_configs = kernels.default_config, kernels.sweep_configs
    table: dict[str, dict[str, Any]] = {}
    for tokens in buckets:
        x = torch.randn(tokens, h, device=device, dtype=torch.bfloat16)
        logits = F.linear(x, router_w)

        def run(config, weights, x=x, logits=logits):
            if not shape.group_size:
                return fused_moe.fused_moe(x, logits, *weights[:4], k, shape.norm_topk_prob, config)
            zps = dict(zip(("w13_zp", "w2_zp"), weights[4:], strict=False))
            return fused_moe_w4a16.fused_moe_w4a16(
                x, logits, *weights[:4], k, shape.norm_topk_prob, config, group_size=shape.group_size, **zps
            )

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
