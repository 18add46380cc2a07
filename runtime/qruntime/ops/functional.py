"""Torch reference math of the operator contract (docs/OPS.md), as plain functions.

The op classes bind these to graph nodes; fused ops are compositions of them, so a fused and an
unfused graph compute the same thing. Everything here runs on any torch device.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm over the last dim: normalize in fp32, cast back, then times the weight."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def dynamic_quant(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (group_size 0), per-group (n > 0) or per-tensor (-1) FP8 quantization.
    x [T, K] -> xq fp8 [T, K], xs f32 [T, G] (G = 1 per token or per tensor, else ceil(K / n)).

    Per-tensor takes one scale over every token of the step and repeats it on each row, so PTPCLinear
    consumes it as it does per-token scales. As in vLLM's dynamic per-tensor FP8, a sequence's
    output then depends on what else is in its batch: the largest |x| of any token sets the scale
    (the padding rows of a captured decode bucket included)."""
    if group_size == -1:
        return _per_tensor_quant(x)
    x32 = x.float()
    rows, cols = x32.shape
    width = cols if group_size == 0 else group_size
    groups = -(-cols // width)
    padded = torch.nn.functional.pad(x32, (0, groups * width - cols)).reshape(rows, groups, width)
    scale = torch.clamp(padded.abs().amax(-1) / FP8_MAX, min=MIN_SCALE)  # [T, G]
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).reshape(rows, -1)[:, :cols]
    return q.to(FP8), scale


def _per_tensor_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> xq fp8 [T, K], xs f32 [T, 1]: one scale max(amax(|x|) / 448, 1e-12) for all of x."""
    x32 = x.float()
    amax = x32.abs().amax() if x32.numel() else x32.new_zeros(())
    scale = torch.clamp(amax / FP8_MAX, min=MIN_SCALE)  # []
    q = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.expand(x32.shape[0], 1).contiguous()


def ptpc_linear(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, out_dtype) -> torch.Tensor:
    """FP8 x FP8 with fp32 accumulation, then per-token times per-channel scale. [T,K] x [N,K] -> [T,N].

    fp8 -> fp32 is exact, so the fp32 matmul is the FP8 product accumulated in fp32."""
    return ((xq.float() @ w.float().T) * xs * ws.float().T).to(out_dtype)


def block_fp8_linear(
    xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, block_n: int, block_k: int, out_dtype
) -> torch.Tensor:
    """Block-scaled FP8: partial products per K block, each times xs[t, kb] * ws[nb, kb]."""
    n, k = w.shape
    y = torch.zeros(xq.shape[0], n, dtype=torch.float32, device=xq.device)
    for kb in range(-(-k // block_k)):
        cols = slice(kb * block_k, (kb + 1) * block_k)
        part = xq[:, cols].float() @ w[:, cols].float().T  # [T, N]
        w_scale = ws[:, kb].float().repeat_interleave(block_n)[:n]  # [N]
        y += part * xs[:, kb : kb + 1] * w_scale[None]
    return y.to(out_dtype)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., K/8] -> int4 values [..., K] in [-8, 7] (int8): column j of a row is bits 4 (j mod 8)
    of word j // 8, stored as value + 8 (compressed-tensors' `pack-quantized`)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    codes = (packed[..., None] >> shifts) & 0xF  # the arithmetic shift's sign bits are masked off
    return (codes.reshape(*packed.shape[:-1], -1) - 8).to(torch.int8)


def dequantize_int4(w: torch.Tensor, ws: torch.Tensor, group_size: int, wz: torch.Tensor | None = None) -> torch.Tensor:
    """Packed int4 w [N, K/8] and scales ws [N, K/group_size] -> q * scale [N, K] in ws's dtype; with
    zero-point codes wz (uint8 [N, K/group_size], 0..15) (code - wz) * scale, code = q + 8."""
    q = unpack_int4(w)
    n, k = q.shape
    groups = q.reshape(n, k // group_size, group_size)
    if wz is not None:  # q - (wz - 8) = code - wz: an integer in [-15, 15], exact in any float dtype
        groups = groups.to(torch.int16) - (wz.to(torch.int16) - 8)[..., None]
    return (groups.to(ws.dtype) * ws[..., None]).reshape(n, k)


def w4a16_linear(
    x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, group_size: int, wz: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] (model dtype) times the dequantized int4 weight [N, K], transposed -> [T, N], a Gemm
    in x's dtype: the weight's values q * scale (with zero points (code - wz) * scale) rounded to that
    dtype, as compressed-tensors dequantizes them."""
    return torch.nn.functional.linear(x, dequantize_int4(w, ws.to(x.dtype), group_size, wz))


def check_mrope_section(section, head_dim: int) -> tuple[int, int, int]:
    """The interleaved M-RoPE section [s_t, s_h, s_w] as a tuple, or ValueError: three non-negative
    integers summing to head_dim / 2 (docs/vision.md)."""
    values = tuple(section) if isinstance(section, (list, tuple)) else None
    if values is None or len(values) != 3 or not all(isinstance(s, int) and not isinstance(s, bool) for s in values):
        raise ValueError(f"mrope_section must be three integers [s_t, s_h, s_w], got {section!r}")
    if min(values) < 0 or sum(values) != head_dim // 2:
        raise ValueError(f"mrope_section {list(values)} must be non-negative and sum to head_dim/2 = {head_dim // 2}")
    return values  # type: ignore[return-value]


def mrope_axes(section: tuple[int, int, int], half: int) -> list[int]:
    """The positions row (0 t, 1 h, 2 w) each of the `half` rotary frequencies reads: j takes row 1
    when j mod 3 = 1 and j < 3·s_h, row 2 when j mod 3 = 2 and j < 3·s_w, else row 0 (transformers'
    apply_interleaved_mrope)."""
    return [
        1 if j % 3 == 1 and j < 3 * section[1] else 2 if j % 3 == 2 and j < 3 * section[2] else 0 for j in range(half)
    ]


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float,
    head_dim: int,
    mrope_section: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Rotate-half (NeoX) RoPE on x [T, heads, d], cos/sin in fp32.

    positions [T]; with mrope_section (Qwen3-VL's interleaved M-RoPE, see mrope_axes) positions
    [3, T], each frequency's angle taking its position from one of the rows. The angle arithmetic is
    the same either way: fp32(position) * inv_freq."""
    t = x.shape[0]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=x.device) / head_dim))
    if mrope_section is None:
        if positions.shape != (t,):
            raise ValueError(f"RoPE: positions must be [{t}] (no mrope_section), got {list(positions.shape)}")
        freqs = positions.float()[:, None] * inv_freq[None]  # [T, d/2]
    else:
        if positions.shape != (3, t):
            raise ValueError(
                f"RoPE with mrope_section {list(mrope_section)}: positions must be [3, {t}], got {list(positions.shape)}"
            )
        axes = torch.tensor(mrope_axes(mrope_section, head_dim // 2), device=positions.device)
        freqs = positions[axes].T.float() * inv_freq[None]  # [T, d/2]: each frequency's row of positions
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [T, 1, d]
    x32 = x.float()
    half = head_dim // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate rows then up rows) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, -1)
    return gate * torch.sigmoid(gate) * up


def moe_routing(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32, top-k, optional renormalisation; weights cast to the logits' dtype."""
    probs = logits.float().softmax(-1)
    weights, ids = probs.topk(top_k, -1)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), ids
