"""FP8 weight quantization: the chunked math equals the whole-tensor math, and the edge cases."""

import pytest
import torch

from qcompile.quant import SCHEMES, get_scheme
from qcompile.quant.fp8 import FP8_MAX, quantize_per_block, quantize_per_channel


def _weight(rows: int, cols: int) -> torch.Tensor:
    return (torch.randn(rows, cols) * 0.05).to(torch.bfloat16)


def test_per_channel_chunks_equal_whole_tensor():
    w = _weight(203, 96)
    q, s = quantize_per_channel(w)
    parts = [quantize_per_channel(w[a:b]) for a, b in ((0, 1), (1, 64), (64, 203))]
    assert torch.equal(torch.cat([p[0] for p in parts]).view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(torch.cat([p[1] for p in parts]), s)


def test_per_channel_scale_and_range():
    w = _weight(64, 80)
    q, s = quantize_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.bfloat16 and s.shape == (64, 1)
    amax = w.abs().amax(dim=1, keepdim=True)
    assert torch.equal(s, amax / torch.tensor(FP8_MAX, dtype=torch.bfloat16))
    # each row's largest magnitude lands at (or within bf16 rounding of) the fp8 maximum
    top = q.float().abs().amax(dim=1)
    assert bool((top >= 416).all()) and bool((top <= FP8_MAX).all())
    # dequantized weights stay within fp8's relative precision (3 mantissa bits)
    err = (q.float() * s.float() - w.float()).abs()
    assert bool((err <= amax.float() / 448 * 32 + 1e-6).all())


def test_zero_row_gets_epsilon_scale_and_zero_bytes():
    w = _weight(8, 32)
    w[3] = 0
    q, s = quantize_per_channel(w)
    assert s[3, 0].item() == torch.finfo(torch.bfloat16).eps
    assert bool((q[3].view(torch.uint8) == 0).all())


def test_block_scales_with_ragged_edges():
    w = _weight(300, 200)  # neither dim a multiple of 128
    q, s = quantize_per_block(w, (128, 128))
    assert s.shape == (3, 2)
    for bi in range(3):
        for bj in range(2):
            tile = w[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128]
            assert s[bi, bj] == tile.abs().amax() / torch.tensor(448.0, dtype=torch.bfloat16)
    # chunks aligned to 128 rows reproduce the whole
    q1, s1 = quantize_per_block(w[:128], (128, 128))
    q2, s2 = quantize_per_block(w[128:], (128, 128))
    assert torch.equal(torch.cat([q1, q2]).view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(torch.cat([s1, s2]), s)


def test_registry():
    assert set(SCHEMES) == {"ptpc-fp8", "block-fp8", "none"}
    assert get_scheme("ptpc-fp8").scale_shape((10, 20)) == (10, 1)
    assert get_scheme("block-fp8").scale_shape((300, 129)) == (3, 2)
    assert get_scheme("none").scale_shape((3, 4)) is None
    with pytest.raises(KeyError, match="known: ptpc-fp8"):
        get_scheme("int4")
    with pytest.raises(TypeError):
        get_scheme("none").quantize(_weight(2, 2))
