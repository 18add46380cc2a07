"""The reference RoPE ops with Qwen3-VL's interleaved M-RoPE (mrope_section, positions [3, T]) against
the vision package's independent reference: qruntime.vision.reference_text.apply_rope with the cos /
sin of qruntime.vision.positions.mrope_cos_sin (checked there against transformers). Bit for bit in
fp32; in bf16 the op rounds its fp32 result once, the reference's fp32 result rounded the same way."""

from __future__ import annotations

import pytest
import torch
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS
from qruntime.ops import functional as fn
from qruntime.ops.attention import QKNormRoPEKVWrite, RoPE
from qruntime.ops.base import OpBindError, OpEnv, StepContext
from qruntime.vision.positions import MRopeConfig, mrope_cos_sin
from qruntime.vision.reference_text import apply_rope
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

THETA = 5e6
SECTIONS = [(128, (24, 20, 20)), (64, (12, 11, 9)), (64, (16, 8, 8))]


def _gen(rng) -> torch.Generator:
    return torch.Generator().manual_seed(rng.randrange(1 << 30))


def _positions(gen: torch.Generator, t: int) -> torch.Tensor:
    """int64 [3, T], the three rows different, as a transposed (non-contiguous) view."""
    return torch.randint(0, 100_000, (t, 3), generator=gen).T


@pytest.mark.parametrize("d, section", SECTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mrope_rope_equals_the_vision_reference(rng, d, section, dtype):
    gen, t, heads = _gen(rng), 13, 3
    x = (torch.randn(t, heads, d, generator=gen) * 3).to(dtype)
    positions = _positions(gen, t)
    op = RoPE({"theta": THETA, "head_dim": d, "mrope_section": list(section)}, None)
    cos, sin = mrope_cos_sin(positions, MRopeConfig(d, THETA, section))
    ref = apply_rope(x.float(), cos, sin).to(dtype)
    ours = op(None, x, positions)
    assert ours.dtype == dtype and torch.equal(ours, ref)
    # a frequency on the wrong row changes the result: plain RoPE of any one row differs
    for row in range(3):
        assert not torch.equal(fn.rope(x, positions[row], THETA, d), ours)


@pytest.mark.parametrize("d, section", [(64, (8, 12, 12)), (128, (24, 20, 20))])
def test_mrope_rope_equals_transformers_recomposition(rng, d, section):
    """transformers' own recomposition (Qwen3VLTextRotaryEmbedding.recomposition_frequencies), also for
    a section whose h / w slices run past d/2 (8, 12, 12 at d 64: transformers' slices stop at d/2,
    which MRopeConfig refuses)."""
    gen, t = _gen(rng), 11
    x = torch.randn(t, 2, d, generator=gen)
    positions = _positions(gen, t)
    inv_freq = 1.0 / (THETA ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = positions[:, None, :, None].float() * inv_freq  # [3, 1, T, d/2], transformers' layout
    module = type("Rotary", (), {"mrope_section": list(section)})()
    cos = Qwen3VLTextRotaryEmbedding.recomposition_frequencies(module, freqs.cos())[0]
    sin = Qwen3VLTextRotaryEmbedding.recomposition_frequencies(module, freqs.sin())[0]
    ours = RoPE({"theta": THETA, "head_dim": d, "mrope_section": list(section)}, None)(None, x, positions)
    assert torch.equal(ours, apply_rope(x, cos, sin))


@pytest.mark.parametrize("d, section", [*SECTIONS, (64, (8, 12, 12))])
def test_mrope_with_equal_rows_is_plain_rope(rng, d, section):
    gen, t = _gen(rng), 9
    x = torch.randn(t, 2, d, generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, 100_000, (t,), generator=gen)
    plain = RoPE({"theta": THETA, "head_dim": d}, None)(None, x, positions)
    mrope = RoPE({"theta": THETA, "head_dim": d, "mrope_section": section}, None)(None, x, positions.expand(3, t))
    assert torch.equal(plain, mrope)


def test_fused_op_is_norm_then_mrope(rng):
    """QKNormRoPEKVWrite with mrope_section: q and the cached k are RMSNorm then the M-RoPE of fn.rope."""
    gen, (nh, kvh, d, t), section = _gen(rng), (4, 2, 64, 5), (16, 8, 8)
    spec = KVCacheSpec(KV_LAYOUTS["nhd"], "bf16", 16, 1, kvh, d)
    cache = KVCache(spec, 2, torch.float32, torch.device("cpu"))
    attrs = {"layer": 0, "layout": "nhd", "block_size": 16, "kv_dtype": "bf16", "k_scale": 1.0, "v_scale": 1.0}
    attrs |= {"num_heads": nh, "num_kv_heads": kvh, "head_dim": d, "epsilon": 1e-6, "theta": THETA}
    op = QKNormRoPEKVWrite(attrs | {"mrope_section": list(section)}, OpEnv(torch.float32, torch.device("cpu"), spec))
    qkv = torch.randn(t, (nh + 2 * kvh) * d, generator=gen)
    qw, kw = torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5
    positions, slots = _positions(gen, t), torch.arange(t)
    q, _ = op(StepContext(cache, None), qkv, qw, kw, positions, slots)
    cos, sin = mrope_cos_sin(positions, MRopeConfig(d, THETA, section))
    assert torch.equal(q, apply_rope(fn.rms_norm(qkv[:, : nh * d].reshape(t, nh, d), qw, 1e-6), cos, sin))
    k_ref = apply_rope(fn.rms_norm(qkv[:, nh * d : (nh + kvh) * d].reshape(t, kvh, d), kw, 1e-6), cos, sin)
    assert torch.equal(cache.gather(0, slots, 1.0, 1.0)[0], k_ref)


def test_positions_shape_is_checked(rng):
    x = torch.randn(4, 2, 64, generator=_gen(rng))
    with pytest.raises(ValueError, match=r"mrope_section \[16, 8, 8\]: positions must be \[3, 4\]"):
        fn.rope(x, torch.arange(4), THETA, 64, (16, 8, 8))
    with pytest.raises(ValueError, match=r"positions must be \[4\] \(no mrope_section\)"):
        fn.rope(x, torch.zeros(3, 4, dtype=torch.int64), THETA, 64)


@pytest.mark.parametrize("bad", [[16, 8], [16, 8, 9], [40, -4, -4], [16.0, 8, 8], 32])
def test_bad_sections_fail_at_bind_naming_the_attribute(bad):
    with pytest.raises(OpBindError, match="attribute mrope_section"):
        RoPE({"theta": THETA, "head_dim": 64, "mrope_section": bad}, None)
