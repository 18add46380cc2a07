"""FP8 weight quantization: the chunked math equals the whole-tensor math, and the edge cases."""

import random

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import quantize
from compressed_tensors.quantization.utils import calculate_qparams

from qcompile.quant import SCHEMES, get_scheme
from qcompile.quant.fp8 import FP8_MAX, quantize_per_block, quantize_per_channel, quantize_per_tensor, tensor_amax


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


TENSOR_ARGS = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)


def _compressed_tensors_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' own `strategy: tensor` weight path: min/max of the whole tensor in its dtype
    (llm-compressor's memoryless min-max observer), calculate_qparams, then quantize to fp8 as its
    compressor does for a symmetric scheme (no zero point: adding a zero one would turn -0 into +0)."""
    lo, hi = torch.aminmax(w)
    scale, _ = calculate_qparams(lo.reshape(1), hi.reshape(1), TENSOR_ARGS)
    return quantize(w, scale, None, TENSOR_ARGS, dtype=torch.float8_e4m3fn), scale


@pytest.mark.parametrize("shape", [(1, 64), (203, 96), (64, 200)])
def test_per_tensor_equals_compressed_tensors(shape):
    w = _weight(*shape) * random.choice([1e-3, 1.0, 300.0])  # another magnitude each run
    q, s = quantize_per_tensor(w)
    ref_q, ref_s = _compressed_tensors_per_tensor(w)
    assert s.dtype == ref_s.dtype == torch.bfloat16 and s.shape == ref_s.shape == (1,)
    assert torch.equal(s.view(torch.int16), ref_s.view(torch.int16))
    assert q.dtype == ref_q.dtype and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    # the largest magnitude lands at (or within bf16 rounding of) 448
    assert 416 <= float(q.float().abs().max()) <= FP8_MAX


def test_per_tensor_zero_tensor_gets_epsilon_scale():
    w = torch.zeros(5, 16, dtype=torch.bfloat16)
    w[2, 3] = -0.0
    q, s = quantize_per_tensor(w)
    ref_q, ref_s = _compressed_tensors_per_tensor(w)
    assert s.item() == ref_s.item() == torch.finfo(torch.bfloat16).eps
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_per_tensor_chunks_with_the_prepass_amax_equal_whole_tensor():
    w = _weight(203, 96)
    w[random.randrange(203), random.randrange(96)] = 0.9  # the tensor's amax sits in one chunk only
    q, s = quantize_per_tensor(w)
    bounds = sorted({0, 203, *random.sample(range(1, 203), 4)})
    chunks = [w[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    amax = torch.cat([tensor_amax(c) for c in chunks]).amax().reshape(1)  # the writer's pre-pass
    assert torch.equal(amax, w.abs().amax().reshape(1))
    scheme = get_scheme("tensor-fp8")
    parts = [scheme.quantize(c, amax) for c in chunks]
    assert torch.equal(torch.cat([p[0] for p in parts]).view(torch.uint8), q.view(torch.uint8))
    assert all(p[1].shape == (c.shape[0], 1) and bool((p[1] == s).all()) for p, c in zip(parts, chunks, strict=True))
    # without the pre-pass a chunk would get its own, smaller scale
    alone = [quantize_per_tensor(c)[1] for c in chunks]
    assert any(not torch.equal(a, s) for a in alone)


def test_registry():
    assert set(SCHEMES) == {"ptpc-fp8", "tensor-fp8", "block-fp8", "w4a16", "w4a16-zp", "none"}
    zp = get_scheme("w4a16-zp")  # w4a16 plus one uint8 zero-point code per scale, read from checkpoints only
    assert zp.zero_point and not get_scheme("w4a16").zero_point and zp.linear_op == "W4A16Linear"
    assert zp.stored_shape((10, 256)) == (10, 32) and zp.scale_shape((10, 256)) == (10, 2)
    with pytest.raises(TypeError, match="pre-quantized checkpoints only"):
        zp.quantize(torch.ones(4, 128, dtype=torch.bfloat16))
    int4 = get_scheme("w4a16")  # weight-only: packed int32 words of 8 columns, one scale per 128 columns
    assert int4.quantized and not int4.quantizes_activations and int4.linear_op == "W4A16Linear"
    assert int4.weight_key == "weight_packed" and int4.weight_dtype(torch.bfloat16) == torch.int32
    assert int4.stored_shape((10, 256)) == (10, 32) and int4.logical_shape((10, 32)) == (10, 256)
    assert int4.scale_shape((10, 256)) == (10, 2) and int4.row_align == 1 and not int4.per_tensor
    assert get_scheme("ptpc-fp8").weight_key == "weight" and get_scheme("ptpc-fp8").stored_shape((3, 4)) == (3, 4)
    tensor = get_scheme("tensor-fp8")
    assert tensor.per_tensor and tensor.row_align == 1 and tensor.activation_group == -1
    assert tensor.linear_op == "PTPCLinear" and tensor.scale_shape((10, 20)) == (10, 1)
    assert not any(get_scheme(name).per_tensor for name in ("ptpc-fp8", "block-fp8", "none"))
    assert get_scheme("ptpc-fp8").scale_shape((10, 20)) == (10, 1)
    assert get_scheme("block-fp8").scale_shape((300, 129)) == (3, 2)
    assert get_scheme("none").scale_shape((3, 4)) is None
    with pytest.raises(KeyError, match="known: ptpc-fp8"):
        get_scheme("int4")
    with pytest.raises(TypeError):
        get_scheme("none").quantize(_weight(2, 2))
