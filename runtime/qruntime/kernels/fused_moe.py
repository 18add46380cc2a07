"""The fused FP8 MoE (the `MoE` op with linear PTPCLinear, group_size 0): the router GEMM, then
five Triton launches; for a single token (batch-1 decode) four in all, the router GEMV, routing,
quantization and the pairs' layout being one launch (moe_routing.moe_router_one):

    logits = x · router_wᵀ (torch)
    moe_route_quant   softmax / top-k / renormalise, and x -> (xq, xs)      [T programs]
    moe_align         pairs grouped by expert, padded to BLOCK_M            [1 program; none at T = 1]
    moe_up_silu       grouped w13 GEMM + SiLU-mul -> act, row amax          [max_blocks x I / BLOCK_N]
    moe_down          act quantized on load, grouped w2 GEMM, x weight      [max_blocks x H / BLOCK_N]
    moe_combine       each token's k rows added in slot order               [T x H / 1024]

A single token's projections run by default as GEMVs (moe_gemv.py: moe_up_one, moe_down_one over
the k slots directly, no pair list), which reach more of the bandwidth at one token than the
grouped GEMMs' 16-row tiles; a MoEGemvConfig selects them, a MoEConfig the grouped GEMMs.

Every buffer and grid is a function of T (static shapes, no host sync: CUDA-graph capturable).
The reference is qruntime.ops.moe.MoE; each kernel's module says how its arithmetic follows it.
MoEConfig (or at one token MoEGemvConfig) is the launch configuration the tuner records per token
bucket (kernels/<device>.json, key table_key(...); config_from_dict reads either); default_config
is the heuristic used where nothing was tuned. Steps 1-2 are route(), which fused_moe_w4a16.py
(int4 experts: their own expert GEMMs, these configs, another table key) shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton

from qruntime.kernels.dynamic_quant import FP8_FORMATS, check_model_dtype
from qruntime.kernels.moe_align import moe_align
from qruntime.kernels.moe_combine import PairRows, moe_combine
from qruntime.kernels.moe_gemm import PairBlocks, moe_down, moe_up_silu
from qruntime.kernels.moe_gemv import MoEGemvConfig, default_gemv_config, gemv_sweep, moe_down_one, moe_up_one
from qruntime.kernels.moe_routing import moe_route_quant, moe_route_quant_one, moe_router_one

_NUM_SMS_H100 = 132  # the heuristic's target; the tuner replaces it per device
_GEMMS = ("w13", "w2")
_TILE_KEYS = ("block_n", "block_k", "num_warps", "num_stages")


def _pow2(name: str, v: int, least: int) -> None:
    if v < least or v & (v - 1):
        raise ValueError(f"{name} must be a power of two >= {least}, got {v}")


@dataclass(frozen=True)
class TileConfig:
    """Launch parameters of one grouped GEMM (its BLOCK_M is MoEConfig.block_m)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        _pow2("block_n", self.block_n, 16)
        _pow2("block_k", self.block_k, 32)  # fp8 MMA's K step
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be a power of two <= 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


@dataclass(frozen=True)
class MoEConfig:
    """Launch configuration of fused_moe: the pair-block height and each GEMM's tiles."""

    block_m: int
    w13: TileConfig  # up projection + SiLU-mul (N = I, K = H)
    w2: TileConfig  # down projection + routing weight (N = H, K = I)

    def __post_init__(self) -> None:
        _pow2("block_m", self.block_m, 16)

    def to_dict(self) -> dict[str, int]:
        """Flat JSON record: block_m, w13_block_n, ..., w2_num_stages."""
        out = {"block_m": self.block_m}
        for gemm in _GEMMS:
            tile = getattr(self, gemm)
            out.update({f"{gemm}_{key}": getattr(tile, key) for key in _TILE_KEYS})
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MoEConfig:
        """Inverse of to_dict (other keys, such as a tuner's timings, are ignored)."""
        try:
            tiles = {gemm: TileConfig(**{key: int(d[f"{gemm}_{key}"]) for key in _TILE_KEYS}) for gemm in _GEMMS}
            return cls(int(d["block_m"]), **tiles)
        except KeyError as exc:
            raise ValueError(f"MoE config {dict(d)} lacks {exc}") from None


def table_key(num_experts: int, inter2: int, hidden: int, top_k: int) -> str:
    """The kernel-table key of a MoE layer: w13 [E, 2I, H], top-k routing."""
    return f"MoE:{num_experts}x{inter2}x{hidden}:top{top_k}"


def _active_blocks(tokens: int, num_experts: int, top_k: int, block_m: int) -> int:
    """Expected pair blocks of a step with uniform random routing (distinct experts hit, each
    with its expected share of the pairs, rounded up to blocks)."""
    pairs = tokens * top_k
    hit = num_experts * (1 - (1 - 1 / num_experts) ** pairs)
    return max(1, round(hit * triton.cdiv(max(1, round(pairs / hit)), block_m)))


def _decode_tile(blocks: int, n: int, k: int, widths: tuple[int, ...]) -> TileConfig:
    """The widest BLOCK_N of `widths` whose programs still cover every SM (else the narrowest):
    at a few tokens streaming the active experts' weights is the whole cost."""
    block_k = 256 if k % 256 == 0 or k > 1024 else 128
    for bn in widths:
        if blocks * triton.cdiv(n, bn) >= _NUM_SMS_H100:
            return TileConfig(bn, block_k, 4, 4)
    return TileConfig(widths[-1], block_k, 4, 4)


def config_from_dict(d: dict[str, Any]) -> MoEConfig | MoEGemvConfig:
    """A tuned table record: MoEGemvConfig where it says gemv (one token), else MoEConfig."""
    return MoEGemvConfig.from_dict(d) if d.get("gemv") else MoEConfig.from_dict(d)


def default_config(tokens: int, num_experts: int, inter: int, hidden: int, top_k: int) -> MoEConfig | MoEGemvConfig:
    """Heuristic config by the pairs per hit expert (H100-sized: 132 SMs).

    - 1 token: the GEMV path (moe_gemv.default_gemv_config).
    - <= 16 (decode): 16-row blocks (mma.sync); the widest column tile that still gives >= 132
      programs over the expected hit experts, deep pipelines of 128-256 wide K steps.
    - <= 64: 32-row blocks, 64-wide tiles.
    - more (prefill): 64-row blocks; up 64 wide (two accumulators: gate and up), down 128 wide."""
    if tokens == 1:
        return default_gemv_config(inter, hidden, top_k)
    return grouped_config(tokens, num_experts, inter, hidden, top_k)


def grouped_config(tokens: int, num_experts: int, inter: int, hidden: int, top_k: int) -> MoEConfig:
    """default_config's grouped-GEMM config (also what a GEMV config falls back to above one token)."""
    pairs = tokens * top_k
    per_expert = pairs / min(num_experts, max(1, pairs))
    if per_expert <= 16:
        blocks = _active_blocks(tokens, num_experts, top_k, 16)
        return MoEConfig(
            16,
            _decode_tile(blocks, inter, hidden, (64, 32, 16)),
            _decode_tile(blocks, hidden, inter, (128, 64, 32)),
        )
    if per_expert <= 64:
        return MoEConfig(32, TileConfig(64, 128, 4, 4), TileConfig(64, 128, 4, 4))
    return MoEConfig(64, TileConfig(64, 128, 4, 3), TileConfig(128, 128, 4, 3))


def sweep_configs(
    tokens: int, num_experts: int, inter: int, hidden: int, top_k: int
) -> list[MoEConfig | MoEGemvConfig]:
    """A small candidate list for the tuner to time; default_config comes first (at one token the
    GEMV candidates, then the grouped GEMMs' own)."""
    cands: list[MoEConfig | MoEGemvConfig] = gemv_sweep(inter, hidden, top_k) if tokens == 1 else []
    cands.append(grouped_config(tokens, num_experts, inter, hidden, top_k))
    pairs = tokens * top_k
    per_expert = pairs / min(num_experts, max(1, pairs))
    if per_expert <= 16:
        for bn13, bn2, bk, stages in (
            (16, 32, 256, 4),
            (32, 64, 256, 4),
            (32, 64, 128, 6),
            (64, 128, 128, 4),
            (16, 64, 128, 6),
            (32, 32, 256, 3),
        ):
            cands.append(MoEConfig(16, TileConfig(bn13, bk, 4, stages), TileConfig(bn2, bk, 4, stages)))
    elif per_expert <= 128:
        for bm, bn13, bn2, warps, stages in (
            (16, 64, 64, 4, 4),
            (32, 64, 128, 4, 4),
            (32, 128, 128, 4, 3),
            (64, 64, 128, 4, 3),
            (64, 64, 64, 4, 4),
        ):
            cands.append(MoEConfig(bm, TileConfig(bn13, 128, warps, stages), TileConfig(bn2, 128, warps, stages)))
    else:
        for bm, bn13, bn2, warps, stages in (
            (64, 128, 128, 8, 3),
            (64, 64, 256, 8, 3),
            (128, 64, 128, 8, 3),
            (128, 128, 128, 8, 3),
            (128, 64, 256, 8, 3),
            (64, 64, 128, 4, 4),
        ):
            cands.append(MoEConfig(bm, TileConfig(bn13, 128, warps, stages), TileConfig(bn2, 128, warps, stages)))
    return list(dict.fromkeys(cands))


def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor | None,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    config: MoEConfig | MoEGemvConfig | None = None,
    router: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    pdl: bool = False,
    defer_combine: bool = False,
) -> torch.Tensor | PairRows:
    """The MoE op (PTPC FP8 experts, per-token FP8 activations): x [T, H] bf16 | fp16 | fp32,
    router_logits [T, E] = x · router_wᵀ, w13 [E, 2I, H] fp8 (gate rows then up rows), w13_scale
    [E, 2I, 1], w2 [E, H, I] fp8, w2_scale [E, H, 1] -> y [T, H] in x's dtype.
    config: default_config(T, E, I, H, k) when None; a MoEGemvConfig runs one token's projections
    as GEMVs (above one token it stands for grouped_config's). router: (router_w [E, H], a zero int32
    counter), for a single token the router GEMV then runs in its routing launch (router_logits may
    be None then; moe_routing.moe_router_one); a third element (residual, norm weight, residual_out,
    eps) makes x AddRMSNorm's x, normalized in that launch (moe_router_one's rms). pdl: every launch with programmatic dependent launch
    (kernels/pdl.py). defer_combine: with k > 1, return the PairRows without the combine launch, for
    a kernel that adds them itself. w13 and w2 float8_e4m3fnuz (amd-gfx942, their scales doubled):
    the activations are quantized to e4m3fnuz with doubled scales, the same result.
    Raises ValueError / TypeError on bad inputs."""
    check_model_dtype("x", x)
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 [E, 2I, H] and w2 [E, H, I] must be 3-D, got {tuple(w13.shape)}, {tuple(w2.shape)}")
    if w13.dtype not in FP8_FORMATS or w2.dtype != w13.dtype:
        raise ValueError(
            f"w13 must be float8_e4m3fn or float8_e4m3fnuz, and w2 of its format, got {w13.dtype} and {w2.dtype}"
        )
    fp8 = w13.dtype  # the activations' format: the target's (qruntime.target)
    tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    check_routing_inputs(x, router_logits, router, w13, w2)
    if tokens == 0:
        return torch.zeros_like(x)
    cfg = config or default_config(tokens, num_experts, inter, hidden, top_k)
    if isinstance(cfg, MoEGemvConfig) and tokens != 1:
        cfg = grouped_config(tokens, num_experts, inter, hidden, top_k)
    gemv = isinstance(cfg, MoEGemvConfig)
    block_m = 16 if gemv else cfg.block_m  # the one-token layout below, unread on the GEMV path
    (weights, ids, xq, xs), layout = route(
        x, router_logits, router, num_experts, top_k, norm_topk_prob, block_m, pdl, fp8
    )
    sorted_ids, block_expert, num_padded, amax = layout
    if gemv:  # one token: the k slots' experts straight from the routing, no pair list
        act = moe_up_one(xq, xs, w13, w13_scale, ids, x.dtype, cfg.up, pdl=pdl)
        out_pairs = moe_down_one(act, w2, w2_scale, weights, ids, cfg.down, pdl=pdl)
    else:
        blocks = PairBlocks(sorted_ids, block_expert, num_padded, amax, block_m, top_k, tokens * top_k)
        act = moe_up_silu(xq, xs, w13, w13_scale, blocks, x.dtype, **_launch(cfg.w13), pdl=pdl)
        out_pairs = moe_down(act, w2, w2_scale, weights, blocks, **_launch(cfg.w2), pdl=pdl)
    if defer_combine and top_k > 1:
        return PairRows(out_pairs, top_k, pdl)
    return moe_combine(out_pairs, top_k, pdl=pdl)


def check_routing_inputs(
    x: torch.Tensor,
    router_logits: torch.Tensor | None,
    router: tuple[torch.Tensor, torch.Tensor] | None,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> None:
    """ValueError unless router_logits [T, E] (or, for one token, the fused router) agree with x and
    the experts' E."""
    tokens, num_experts = x.shape[0], w13.shape[0]
    if router_logits is None and not (router is not None and tokens == 1):
        raise ValueError("router_logits are needed unless a single token's router runs fused (router=...)")
    logits_shape = (tokens, num_experts) if router_logits is None else tuple(router_logits.shape)
    if logits_shape != (tokens, num_experts) or w2.shape[0] != num_experts:
        raise ValueError(
            f"router_logits {logits_shape}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} "
            f"disagree with x {tuple(x.shape)} on T or E"
        )


def route(
    x: torch.Tensor,
    router_logits: torch.Tensor | None,
    router: tuple[torch.Tensor, torch.Tensor] | None,
    num_experts: int,
    top_k: int,
    norm_topk_prob: bool,
    block_m: int,
    pdl: bool,
    fp8: torch.dtype,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Steps 1-2: routing with x quantized per token to `fp8` (read by FP8 experts only), and the
    pairs grouped by expert in blocks of block_m: ((weights, ids, xq, xs), (sorted_ids, block_expert,
    num_padded, row_amax)). One token: its routing launch lays the pairs out (with the router GEMV
    when `router` is given); more: moe_align groups them."""
    if router is not None and x.shape[0] == 1:  # batch-1 decode: router GEMV, routing, quant, layout
        rms = router[2] if len(router) > 2 else None  # x is AddRMSNorm's x, normalized in the launch
        return moe_router_one(x, router[0], top_k, norm_topk_prob, block_m, router[1], pdl=pdl, fp8=fp8, rms=rms)
    if x.shape[0] == 1:  # the routing launch lays out the k pairs itself
        return moe_route_quant_one(router_logits, x, top_k, norm_topk_prob, block_m, pdl=pdl, fp8=fp8)
    routed = moe_route_quant(router_logits, x, top_k, norm_topk_prob, pdl=pdl, fp8=fp8)
    return routed, moe_align(routed[1], num_experts, block_m, pdl=pdl)


def _launch(tile: TileConfig) -> dict[str, int]:
    return {key: getattr(tile, key) for key in _TILE_KEYS}
