"""The vision graph's ops (qruntime.ops.vision) against plain torch written out independently: the
ONNX formulas of LayerNormalization and Gelu, PositionGrid's weighted sum tap by tap, and
VisionAttention as one masked softmax over all rows (block-diagonal by segment) in float64, its
rotary written as complex rotations of the (i, i + d/2) pairs."""

from __future__ import annotations

import math

import pytest
import torch
from qruntime.ops.base import OpBindError, OpEnv
from qruntime.ops.registry import reference_ops, triton_ops
from qruntime.ops.standard import Gemm
from qruntime.ops.vision import Concat, Gelu, LayerNormalization, PositionGrid, VisionAttention

ENV = OpEnv(torch.float32, torch.device("cpu"), None)  # type: ignore[arg-type]


def _gen(rng) -> torch.Generator:
    return torch.Generator().manual_seed(rng.randrange(1 << 30))


def _relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.double() - reference.double()).abs().max() / reference.double().abs().max()).item()


def test_the_vision_ops_are_registered_in_both_tables():
    for table in (reference_ops(), triton_ops()):
        for key, op in {
            ("", "LayerNormalization"): LayerNormalization,
            ("", "Gelu"): Gelu,
            ("", "Concat"): Concat,
            ("qcompile", "PositionGrid"): PositionGrid,
            ("qcompile", "VisionAttention"): VisionAttention,
        }.items():
            assert table[key] is op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_normalization_is_the_onnx_formula(rng, dtype):
    gen = _gen(rng)
    x = (torch.randn(7, 24, generator=gen) * 3 + 1).to(dtype)
    scale, bias = (1 + torch.randn(24, generator=gen)).to(dtype), torch.randn(24, generator=gen).to(dtype)
    ours = LayerNormalization({"epsilon": 1e-6, "axis": -1}, ENV)(None, x, scale, bias)
    xf = x.double()
    mean, var = xf.mean(-1, keepdim=True), xf.var(-1, unbiased=False, keepdim=True)
    expected = (xf - mean) / torch.sqrt(var + 1e-6) * scale.double() + bias.double()
    assert ours.dtype == dtype
    assert _relative(ours, expected) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_layer_normalization_refuses_another_axis():
    with pytest.raises(OpBindError, match="axis=-1"):
        LayerNormalization({"epsilon": 1e-6, "axis": 0}, ENV)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_is_the_onnx_formula(rng, approximate):
    x = torch.randn(5, 33, generator=_gen(rng), dtype=torch.float64) * 3
    ours = Gelu({"approximate": approximate}, ENV)(None, x.float())
    if approximate == "none":
        expected = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    else:
        expected = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    assert _relative(ours, expected) < 1e-6
    other = Gelu({"approximate": "tanh" if approximate == "none" else "none"}, ENV)(None, x.float())
    assert _relative(other, expected) > 1e-5  # the two approximations do differ on these inputs


def test_gelu_refuses_an_unknown_approximation():
    with pytest.raises(OpBindError, match="approximate='fast'"):
        Gelu({"approximate": "fast"}, ENV)


def test_concat_and_gemm_with_bias(rng):
    gen = _gen(rng)
    a, b, c = (torch.randn(4, n, generator=gen) for n in (3, 5, 2))
    assert torch.equal(Concat({"axis": -1}, ENV)(None, a, b, c)[:, 3:8], b)
    x, w, bias = torch.randn(6, 8, generator=gen), torch.randn(5, 8, generator=gen), torch.randn(5, generator=gen)
    ours = Gemm({"transB": 1}, ENV)(None, x, w, bias)
    expected = x.double() @ w.double().T + bias.double()
    assert _relative(ours, expected) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_position_grid_sums_the_four_weighted_taps_in_float32(rng, dtype):
    gen = _gen(rng)
    table = torch.randn(25, 16, generator=gen).to(dtype)
    index = torch.randint(0, 25, (4, 11), generator=gen)
    weight = torch.rand(4, 11, generator=gen)
    ours = PositionGrid({}, ENV)(None, table, index, weight)
    expected = sum(weight[k, :, None].double() * table[index[k]].double() for k in range(4))
    assert ours.dtype == dtype
    if dtype == torch.float32:  # the float32 products' and sum's roundings
        torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=1e-6)
        return
    # bfloat16: one rounding of the float32 sum (not of each tap): within half a bf16 ulp of the exact
    # sum, plus the float32 products' and sum's own error, a few float32 ulps of the taps' magnitudes
    # (an exact sum that close to a midpoint may round either way: 1 element in 176 of seed 470321508)
    ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(expected.abs().clamp(min=1e-30))))
    magnitude = sum((weight[k, :, None].double() * table[index[k]].double()).abs() for k in range(4))
    error = (ours.double() - expected).abs()
    assert (error <= ulp / 2 + 2.0**-21 * magnitude + 1e-30).all(), float((error / ulp).max())


def _rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x [P, nh, d] with (x_i, x_{i+d/2}) turned by angles [P, d/2] as complex numbers."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vision_attention_is_a_rotary_softmax_inside_each_segment(rng, dtype):
    gen = _gen(rng)
    heads, head_dim, bounds = 3, 8, [0, 5, 5, 12, 13, 20]  # an empty segment and one of a single row
    rows = bounds[-1]
    qkv = torch.randn(rows, 3 * heads * head_dim, generator=gen).to(dtype)
    angles = torch.rand(rows, head_dim // 2, generator=gen, dtype=torch.float64) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).float(), torch.cat([angles.sin()] * 2, -1).float()
    scale = 0.37
    attrs = {"num_heads": heads, "head_dim": head_dim, "scale": scale}
    ours = VisionAttention(attrs, ENV)(None, qkv, cos, sin, torch.tensor(bounds, dtype=torch.int32))

    q, k, v = qkv.double().view(rows, 3, heads, head_dim).unbind(1)
    q, k = _rotary(q, angles), _rotary(k, angles)
    if dtype != torch.float32:  # the op hands the rotated q, k back in the model dtype
        q, k = q.to(dtype).double(), k.to(dtype).double()
    segment = torch.bucketize(torch.arange(rows), torch.tensor(bounds[1:]), right=True)
    same = segment[:, None] == segment[None, :]
    logits = torch.einsum("phd,qhd->hpq", q, k) * scale
    probs = logits.masked_fill(~same, float("-inf")).softmax(-1)
    expected = torch.einsum("hpq,qhd->phd", probs, v).reshape(rows, heads * head_dim)
    assert ours.dtype == dtype and ours.shape == expected.shape
    assert _relative(ours, expected) < (1e-6 if dtype == torch.float32 else 1e-2)
