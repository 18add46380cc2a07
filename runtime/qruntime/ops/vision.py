"""The ops of the Qwen3-VL vision graph (docs/vision.md, "Artifacts"; docs/OPS.md), on torch.

Standard ONNX: LayerNormalization, Gelu, Concat (the vision graph's Gemm with a bias input C is
standard.Gemm). Ours: PositionGrid (the bilinear taps into the learned position grid) and
VisionAttention (rotary plus attention inside each frame). Each computes what
qruntime.vision.tower computes, with the same float32 steps, so the encoder matches the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qruntime.ops.base import Op, OpBindError

_GELU_APPROXIMATIONS = ("none", "tanh")


class LayerNormalization(Op):
    """y = (x - mean) / sqrt(var + epsilon) * Scale + B over the last axis (torch's layer_norm, which
    accumulates in float32 for bfloat16 / float16 inputs: stash_type 1)."""

    attrs = ("epsilon",)
    optional_attrs = {"axis": -1, "stash_type": 1}

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        if self.a["axis"] != -1 or self.a["stash_type"] != 1:
            raise OpBindError(
                f"LayerNormalization is implemented for axis=-1, stash_type=1 (float32), got axis={self.a['axis']}, "
                f"stash_type={self.a['stash_type']}"
            )

    def __call__(self, step, x, scale, bias=None):
        return F.layer_norm(x, (x.shape[-1],), scale, bias, self.a["epsilon"])


class Gelu(Op):
    """GELU, exact (approximate "none") or the tanh approximation."""

    optional_attrs = {"approximate": "none"}

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        if self.a["approximate"] not in _GELU_APPROXIMATIONS:
            raise OpBindError(f"Gelu approximate={self.a['approximate']!r}, expected one of {_GELU_APPROXIMATIONS}")

    def __call__(self, step, x):
        return F.gelu(x, approximate=self.a["approximate"])


class Concat(Op):
    """The inputs joined along `axis`."""

    attrs = ("axis",)

    def __call__(self, step, *xs):
        return torch.cat(xs, dim=self.a["axis"])


class PositionGrid(Op):
    """y [P, C] = Σ_k weight[k] · table[index[k]] (k < 4) in float32, cast to the table's dtype:
    each patch's position embedding, bilinearly read from the learned grid table [n², C]."""

    def __call__(self, step, table, index, weight):
        taps = table[index] * weight[:, :, None]  # [4, P, C] float32
        return taps.sum(dim=0).to(table.dtype)


class VisionAttention(Op):
    """qkv [P, 3·nh·d] → o [P, nh·d]: q, k, v split (q first), the rotate-half rotary on q and k in
    float32 with cos / sin [P, d] (cast back), then softmax(q kᵀ · scale) v over the rows of each
    segment [cu_seqlens[s], cu_seqlens[s+1]) alone, without a mask inside it.

    cu_seqlens is read on the host (one device-to-host sync per call) and the segments of one length
    run as one batched SDPA (an image's frames, same-sized images): not capturable in a CUDA graph."""

    attrs = ("num_heads", "head_dim", "scale")
    capturable = False

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        if self.a["head_dim"] % 2:
            raise OpBindError(f"VisionAttention head_dim={self.a['head_dim']} must be even (rotate-half rotary)")

    def __call__(self, step, qkv, cos, sin, cu_seqlens):
        heads, head_dim = self.a["num_heads"], self.a["head_dim"]
        rows = qkv.shape[0]
        q, k, v = qkv.view(rows, 3, heads, head_dim).unbind(1)  # [P, nh, d] each
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        bounds = cu_seqlens.tolist()
        by_length: dict[int, list[int]] = {}
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
            if stop > start:
                by_length.setdefault(stop - start, []).append(start)
        out = torch.empty_like(q)
        # SDPA always 4-D: PyTorch's flash and memory-efficient kernels take only 4-D inputs; a 3-D
        # [nh, length, d] fell back to the math kernel (the [nh, length, length] scores materialized),
        # which made one 1024 x 1024 image's encoder 170 ms on an H100 against 392 ms for 16 (ad76850)
        for length, starts in by_length.items():
            if len(starts) == 1:  # one segment: a view, as a batch of one
                rows_of = slice(starts[0], starts[0] + length)
                seg = [x[rows_of].transpose(0, 1)[None] for x in (q, k, v)]  # [1, nh, length, d]
                out[rows_of] = F.scaled_dot_product_attention(*seg, scale=self.a["scale"])[0].transpose(0, 1)
                continue
            offsets = torch.arange(length, device=qkv.device)
            rows_of = torch.tensor(starts, device=qkv.device)[:, None] + offsets  # [segments, length]
            seg = [x[rows_of].transpose(-3, -2) for x in (q, k, v)]  # [segments, nh, length, d]
            out[rows_of] = F.scaled_dot_product_attention(*seg, scale=self.a["scale"]).transpose(-3, -2)
        return out.reshape(rows, heads * head_dim)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [P, nh, d] rotated by halves, (x1, x2) → x·cos + (-x2, x1)·sin with cos / sin [P, d], in
    float32; back in x's dtype."""
    xf = x.to(torch.float32)
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)
