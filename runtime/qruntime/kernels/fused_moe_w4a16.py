"""The fused MoE with W4A16 experts (the `MoE` op with linear W4A16Linear: packed int4 weights, group
scales, optional zero points; activations in the model dtype): fused_moe.py's launches with the
expert GEMMs of moe_gemm_w4a16.py (grouped, over moe_align's pair list) and moe_gemv_w4a16.py (one
token, the k slots' experts straight from the routing):

    logits = x · router_wᵀ (torch; for one token in the routing launch, moe_router_one)
    routing           softmax / top-k / renormalise, as for FP8 experts          [T programs]
    moe_align         pairs grouped by expert, padded to BLOCK_M                  [1 program; none at T = 1]
    up + SiLU-mul     grouped w13 GEMM (or one token's GEMV) -> act in D          [blocks x I / BLOCK_N]
    down              grouped w2 GEMM (or GEMV) on act, x routing weight          [blocks x H / BLOCK_N]
    moe_combine       each token's k rows added in slot order                     [T x H / 1024]

The routing launch is the FP8 MoE's, whose per-token FP8 copy of x (a byte per element of x) these
experts do not read. Configs are fused_moe's MoEConfig / MoEGemvConfig, tuned per token bucket
under their own kernel-table key (table_key: the FP8 key plus the int4 layout); a K tile that does
not fit the groups is narrowed to one that does (moe_gemm_w4a16.fit_block_k). Static shapes, no
host sync: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton

from qruntime.kernels.fused_moe import (
    MoEConfig,
    TileConfig,
    _active_blocks,
    _launch,
    check_routing_inputs,
    route,
)
from qruntime.kernels.fused_moe import table_key as fp8_table_key
from qruntime.kernels.moe_combine import PairRows, moe_combine
from qruntime.kernels.moe_gemm import PairBlocks
from qruntime.kernels.moe_gemm_w4a16 import DTYPES, moe_down_w4a16, moe_up_silu_w4a16
from qruntime.kernels.moe_gemv import GemvTile, MoEGemvConfig
from qruntime.kernels.moe_gemv_w4a16 import moe_down_one_w4a16, moe_up_one_w4a16

_NUM_SMS_H100 = 132  # the heuristic's target; the tuner replaces it per device


def table_key(num_experts: int, inter2: int, hidden: int, top_k: int, group_size: int, zero_point: bool) -> str:
    """The kernel-table key of an int4 MoE layer (w13 [E, 2I, H] logical): the FP8 MoE's key plus
    `:w4a16-g{G}` (`:w4a16-zp-g{G}` with zero points), so the two never share records."""
    return f"{fp8_table_key(num_experts, inter2, hidden, top_k)}:w4a16{'-zp' if zero_point else ''}-g{group_size}"


def default_gemv_config(inter: int, hidden: int, top_k: int) -> MoEGemvConfig:
    """One token: 4 warps over 8 weight rows (up: 8 gate and 8 up rows) and K steps of 256 columns
    (128 bytes of each row): the unpacked [8, 256] fp32 tiles stay in registers."""
    del inter, hidden, top_k  # one shape-free choice until the tuner times others
    return MoEGemvConfig(GemvTile(8, 256, 4), GemvTile(8, 256, 4))


def _decode_tile(blocks: int, n: int, widths: tuple[int, ...], block_k: int) -> TileConfig:
    """The widest BLOCK_N of `widths` whose programs still cover every SM (else the narrowest)."""
    for bn in widths:
        if blocks * triton.cdiv(n, bn) >= _NUM_SMS_H100:
            return TileConfig(bn, block_k, 4, 4)
    return TileConfig(widths[-1], block_k, 4, 4)


def grouped_config(tokens: int, num_experts: int, inter: int, hidden: int, top_k: int) -> MoEConfig:
    """The grouped GEMMs' heuristic, by the pairs per hit expert. The unpacked weight tile [BLOCK_N,
    BLOCK_K] lives in registers beside the accumulators (two of each in the up projection: gate and
    up), so the tiles are narrower than the FP8 MoE's and wider ones take 8 warps: decode 16-row
    blocks, up 32 (or 16) x 128, down 64 (or 32) x 128 over 4 warps; above that 32-row (<= 64 pairs
    per expert) or 64-row blocks, up 64 x 64, down 128 x 64 over 8 warps. None of these spills
    registers in an sm_90 build (Triton 3.9: at most 196 of 255)."""
    pairs = tokens * top_k
    per_expert = pairs / min(num_experts, max(1, pairs))
    if per_expert <= 16:
        blocks = _active_blocks(tokens, num_experts, top_k, 16)
        return MoEConfig(16, _decode_tile(blocks, inter, (32, 16), 128), _decode_tile(blocks, hidden, (64, 32), 128))
    return MoEConfig(32 if per_expert <= 64 else 64, TileConfig(64, 64, 8, 3), TileConfig(128, 64, 8, 3))


def default_config(tokens: int, num_experts: int, inter: int, hidden: int, top_k: int) -> MoEConfig | MoEGemvConfig:
    """One token: the GEMVs (default_gemv_config); more: grouped_config."""
    if tokens == 1:
        return default_gemv_config(inter, hidden, top_k)
    return grouped_config(tokens, num_experts, inter, hidden, top_k)


_GEMV_SWEEP = (  # (block_n, block_k, num_warps) of up, of down
    ((4, 256, 4), (8, 256, 4)),
    ((8, 512, 8), (8, 256, 4)),
    ((4, 512, 4), (4, 512, 4)),
    ((16, 256, 8), (16, 128, 4)),
    ((8, 256, 4), (16, 256, 8)),
    ((8, 256, 4), (32, 128, 8)),
)
_DECODE_SWEEP = (
    (16, 32, 128, 4, 4),
    (32, 64, 64, 4, 4),
    (32, 128, 128, 4, 4),
    (16, 64, 64, 8, 4),
)  # bn13, bn2, bk, ...
_MID_SWEEP = (  # block_m, bn13, bn2, bk, warps, stages
    (16, 32, 128, 128, 4, 4),
    (32, 64, 128, 64, 8, 3),
    (64, 64, 128, 64, 8, 3),
    (64, 32, 128, 128, 8, 3),
    (32, 64, 64, 64, 8, 4),
)
_PREFILL_SWEEP = (
    (64, 64, 128, 64, 8, 3),
    (64, 64, 256, 64, 8, 3),
    (128, 64, 128, 64, 8, 3),
    (64, 32, 128, 128, 8, 3),
    (32, 64, 128, 64, 8, 3),
)


def sweep_configs(
    tokens: int, num_experts: int, inter: int, hidden: int, top_k: int
) -> list[MoEConfig | MoEGemvConfig]:
    """Candidates for the tuner; default_config first (at one token the GEMVs, then grouped ones)."""
    cands: list[MoEConfig | MoEGemvConfig] = []
    if tokens == 1:
        cands.append(default_gemv_config(inter, hidden, top_k))
        cands += [MoEGemvConfig(GemvTile(*up), GemvTile(*down)) for up, down in _GEMV_SWEEP]
    cands.append(grouped_config(tokens, num_experts, inter, hidden, top_k))
    pairs = tokens * top_k
    per_expert = pairs / min(num_experts, max(1, pairs))
    if per_expert <= 16:
        for bn13, bn2, bk, warps, stages in _DECODE_SWEEP:
            cands.append(MoEConfig(16, TileConfig(bn13, bk, warps, stages), TileConfig(bn2, bk, warps, stages)))
    else:
        for bm, bn13, bn2, bk, warps, stages in _MID_SWEEP if per_expert <= 128 else _PREFILL_SWEEP:
            cands.append(MoEConfig(bm, TileConfig(bn13, bk, warps, stages), TileConfig(bn2, bk, warps, stages)))
    return list(dict.fromkeys(cands))


def fused_moe_w4a16(
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
    group_size: int,
    w13_zp: torch.Tensor | None = None,
    w2_zp: torch.Tensor | None = None,
    pdl: bool = False,
    defer_combine: bool = False,
    fp8: torch.dtype = torch.float8_e4m3fn,
) -> torch.Tensor | PairRows:
    """The MoE op with W4A16 experts: x [T, H] bf16 | fp16, router_logits [T, E] = x · router_wᵀ,
    w13 int32 [E, 2I, H/8] (gate rows then up rows), w13_scale [E, 2I, H/G], w2 int32 [E, H, I/8],
    w2_scale [E, H, I/G], G = group_size (keyword: the other arguments are fused_moe's, in its
    order); w13_zp / w2_zp uint8 zero-point codes like the scales (asymmetric int4) or None
    (code - 8) -> y [T, H] in x's dtype. config, router, pdl and defer_combine: as fused_moe's; fp8:
    the format of the routing launch's (unread) copy of x, the target's (e4m3fnuz on amd-gfx942). Raises ValueError / TypeError on bad inputs."""
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be bfloat16 or float16 (the W4A16 MoE's activations), got {x.dtype}")
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(
            f"x [T, H], w13 [E, 2I, H/8] and w2 [E, H, I/8] expected, got {tuple(x.shape)}, {tuple(w13.shape)}, "
            f"{tuple(w2.shape)}"
        )
    if (w13_zp is None) != (w2_zp is None):
        raise ValueError("w13_zp and w2_zp come together (asymmetric int4 experts) or not at all")
    tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    check_routing_inputs(x, router_logits, router, w13, w2)
    if tokens == 0:
        return torch.zeros_like(x)
    cfg = config or default_config(tokens, num_experts, inter, hidden, top_k)
    if isinstance(cfg, MoEGemvConfig) and tokens != 1:
        cfg = grouped_config(tokens, num_experts, inter, hidden, top_k)
    gemv = isinstance(cfg, MoEGemvConfig)
    block_m = 16 if gemv else cfg.block_m  # the one-token layout, unread on the GEMV path
    (weights, ids, _, _), layout = route(
        x, router_logits, router, num_experts, top_k, norm_topk_prob, block_m, pdl, fp8
    )
    if gemv:  # one token: the k slots' experts straight from the routing, no pair list
        act = moe_up_one_w4a16(x, w13, w13_scale, ids, group_size, cfg.up, w13_zp=w13_zp, pdl=pdl)
        out_pairs = moe_down_one_w4a16(act, w2, w2_scale, weights, ids, group_size, cfg.down, w2_zp=w2_zp, pdl=pdl)
    else:
        blocks = PairBlocks(*layout, block_m, top_k, tokens * top_k)
        act = moe_up_silu_w4a16(x, w13, w13_scale, blocks, group_size, w13_zp=w13_zp, **_launch(cfg.w13), pdl=pdl)
        out_pairs = moe_down_w4a16(
            act, w2, w2_scale, weights, blocks, group_size, w2_zp=w2_zp, **_launch(cfg.w2), pdl=pdl
        )
    if defer_combine and top_k > 1:
        return PairRows(out_pairs, top_k, pdl)
    return moe_combine(out_pairs, top_k, pdl=pdl)
