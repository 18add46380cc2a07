"""Per-token FP8 quantization kernels (dynamic_quant, add_rmsnorm(_quant), silu_mul_quant) against
the torch references of qruntime.ops.functional.

The references run on the CPU (IEEE fp32 division and rounding). dynamic_quant must match them bit
for bit. The fused kernels follow the references' rounding order exactly, except that their fp32
sum of squares (RMSNorm) and exp (SiLU) may differ from torch's in the last bit: y may then be one
model-dtype ulp away in rare elements, so yq may be one e4m3 step away in rarer ones; ys stays
within rtol 1e-6 and residual_out is exact. Widths are odd on purpose (not multiples of any block);
`max_block` forces the chunked multi-pass paths at small widths.
"""

from __future__ import annotations

import pytest
import torch
from qruntime.kernels.add_rmsnorm_quant import add_rmsnorm, add_rmsnorm_quant
from qruntime.kernels.dynamic_quant import MIN_SCALE, dynamic_quant
from qruntime.kernels.silu_mul_quant import silu_mul, silu_mul_quant
from qruntime.ops import functional as fn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float32]
# (tokens, width, max_block): one tile, one tile of a large row, and the chunked path
SHAPES = [(1, 96, 8192), (5, 130, 8192), (7, 72, 8192), (3, 4096, 8192), (6, 130, 32), (2, 200, 64)]


def _rows(tokens: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows whose magnitudes span 1e-5..1e4 (a different one per row); with 3+ rows, row 1
    holds one value repeated and the last row is tiny (amax / 448 < 1e-12: the scale's floor)."""
    x = torch.randn(tokens, width) * torch.logspace(-5, 4, tokens)[torch.randperm(tokens)][:, None]
    x[:, torch.randint(width, (2,))] = torch.tensor([0.0, -0.0])
    if tokens >= 3:
        x[1] = -3.25
        x[-1] = torch.randn(width) * 1e-14
    return x.to(dtype).to(DEVICE)


def _ordinal(q: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes -> integers in value order (+0 and -0 both 0): adjacent values differ by 1."""
    b = q.cpu().view(torch.uint8).int()
    mag = b & 0x7F
    return torch.where(b >= 0x80, -mag, mag)


def assert_fp8_close(q: torch.Tensor, ref: torch.Tensor, max_mismatch: int) -> None:
    """Bytes equal, but for at most `max_mismatch` elements one e4m3 step away."""
    assert q.dtype == torch.float8_e4m3fn and q.shape == ref.shape
    steps = (_ordinal(q) - _ordinal(ref)).abs()
    assert steps.max().item() <= 1, f"{int((steps > 1).sum())} elements more than one e4m3 step off"
    assert int((steps != 0).sum()) <= max_mismatch, f"{int((steps != 0).sum())} elements differ"


def _check_scales(ys: torch.Tensor, ref: torch.Tensor, exact: bool) -> None:
    assert ys.dtype == torch.float32 and ys.shape == ref.shape
    if exact:
        assert torch.equal(ys.cpu(), ref)
    else:
        torch.testing.assert_close(ys.cpu(), ref, rtol=1e-6, atol=0)


def _rare(numel: int) -> int:
    return 1 + numel // 2000


# ---- dynamic_quant ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize(("tokens", "width", "max_block"), SHAPES)
def test_dynamic_quant_is_bit_exact(dtype, tokens, width, max_block):
    x = _rows(tokens, width, dtype)
    xq, xs = dynamic_quant(x, max_block=max_block)
    ref_q, ref_s = fn.dynamic_quant(x.cpu(), 0)
    assert torch.equal(xq.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    _check_scales(xs, ref_s, exact=True)
    if tokens >= 3:  # the repeated value is the amax: +-448 everywhere; the tiny row is on the floor
        assert torch.all(xq[1].float() == -448.0)
        assert xs[-1].item() == torch.tensor(MIN_SCALE, dtype=torch.float32).item()


def test_dynamic_quant_rounds_ties_to_even():
    """amax 448 makes the scale 1, so xq = fp8(x) exactly: every e4m3 midpoint (normal and
    subnormal, both signs), the values one fp32 ulp either side of it, and the e4m3 values."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2
    near = torch.cat([mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)), grid])
    vals = torch.cat([near, -near])
    width = 64
    rows = -(-vals.numel() // width)
    x = torch.zeros(rows, width + 1)
    x.view(-1)[: vals.numel()] = vals  # the tail of the last row: zeros
    x[:, -1] = 448.0
    xq, xs = dynamic_quant(x.to(DEVICE))
    assert torch.all(xs == 1.0)
    ref_q, _ = fn.dynamic_quant(x, 0)
    assert torch.equal(xq.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(xq.cpu().view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_dynamic_quant_strided_rows_and_no_tokens():
    wide = _rows(4, 160, torch.bfloat16)
    x = wide[:, 3:133]  # row stride 160, 130 columns
    xq, xs = dynamic_quant(x)
    ref_q, ref_s = fn.dynamic_quant(x.cpu(), 0)
    assert torch.equal(xq.cpu().view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(xs.cpu(), ref_s)
    xq, xs = dynamic_quant(torch.empty(0, 96, device=DEVICE))
    assert xq.shape == (0, 96) and xs.shape == (0, 1)
    with pytest.raises(TypeError):
        dynamic_quant(torch.ones(2, 8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError):
        dynamic_quant(torch.ones(2, 3, 8, device=DEVICE))


# ---- add_rmsnorm_quant / add_rmsnorm -----------------------------------------------------------


def _norm_case(tokens: int, width: int, dtype: torch.dtype, with_residual: bool):
    x = _rows(tokens, width, dtype)
    residual = (torch.randn(tokens, width) * 8).to(dtype).to(DEVICE) if with_residual else None
    w = (torch.rand(width) * 2 - 0.5).to(dtype).to(DEVICE)
    return x, residual, w, 1e-6


def _norm_reference(x, residual, w, eps):
    out = x.cpu() if residual is None else x.cpu() + residual.cpu()
    return fn.rms_norm(out, w.cpu(), eps), out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(("tokens", "width", "max_block"), SHAPES)
def test_add_rmsnorm_quant_matches_reference(dtype, with_residual, tokens, width, max_block):
    x, residual, w, eps = _norm_case(tokens, width, dtype, with_residual)
    yq, ys, res_out = add_rmsnorm_quant(x, residual, w, eps, max_block=max_block)
    ref_y, ref_out = _norm_reference(x, residual, w, eps)
    ref_q, ref_s = fn.dynamic_quant(ref_y, 0)
    assert res_out.dtype == dtype and torch.equal(res_out.cpu(), ref_out)
    assert (res_out is x) == (residual is None)  # no residual: residual_out is x, as the reference
    assert_fp8_close(yq, ref_q, _rare(yq.numel()))
    _check_scales(ys, ref_s, exact=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(("tokens", "width", "max_block"), SHAPES)
def test_add_rmsnorm_matches_reference(dtype, with_residual, tokens, width, max_block):
    x, residual, w, eps = _norm_case(tokens, width, dtype, with_residual)
    y, res_out = add_rmsnorm(x, residual, w, eps, max_block=max_block)
    ref_y, ref_out = _norm_reference(x, residual, w, eps)
    assert y.dtype == dtype and torch.equal(res_out.cpu(), ref_out)
    # the rounding order is the reference's; where the fp32 sum of squares came out one bit
    # different, rsqrt moves every fp32 y of the row by a few ulps, and rarely a bf16 n by one ulp,
    # which y = w * n can turn into two
    rtol = torch.finfo(dtype).eps * (4 if dtype == torch.float32 else 2)
    torch.testing.assert_close(y.cpu().float(), ref_y.float(), rtol=rtol, atol=0)
    if dtype != torch.float32:
        assert _flipped_classes(y.cpu() != ref_y, ref_out) <= _rare(y.numel())


def _flipped_classes(differs: torch.Tensor, normed_input: torch.Tensor) -> int:
    """How many (row, significand) classes hold a differing element. A bf16 row has at most 128
    significands, and n = x * rsqrt(ms) rounds the same way for every x of one significand: when
    rsqrt is one fp32 ulp off, one boundary crossing flips the whole class (tens of elements of a
    4096-wide row) at once. The rare event is the crossing, so the classes are what is counted."""
    significand = normed_input.view(torch.int16).int() & 0x7F
    rows = torch.arange(differs.shape[0])[:, None].expand_as(differs)
    return len(set(zip(rows[differs].tolist(), significand[differs].tolist(), strict=True)))


def test_add_rmsnorm_quant_hidden_8192_one_tile():
    x, residual, w, eps = _norm_case(2, 8192, torch.bfloat16, True)
    yq, ys, res_out = add_rmsnorm_quant(x, residual, w, eps)
    ref_y, ref_out = _norm_reference(x, residual, w, eps)
    ref_q, ref_s = fn.dynamic_quant(ref_y, 0)
    assert torch.equal(res_out.cpu(), ref_out)
    assert_fp8_close(yq, ref_q, _rare(yq.numel()))
    _check_scales(ys, ref_s, exact=False)


def test_add_rmsnorm_rejects_mismatched_inputs():
    x, residual, w, eps = _norm_case(2, 64, torch.bfloat16, True)
    with pytest.raises(ValueError):
        add_rmsnorm_quant(x, residual[:, :32], w, eps)
    with pytest.raises(ValueError):
        add_rmsnorm_quant(x, residual.float(), w, eps)
    with pytest.raises(ValueError):
        add_rmsnorm(x, None, w[:32], eps)


# ---- silu_mul_quant ----------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's exp(-gate) -> inf: sigmoid 0
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "width", "max_block"), SHAPES)
def test_silu_mul_quant_matches_reference(dtype, tokens, width, max_block):
    gate_up = torch.cat([_rows(tokens, width, dtype), _rows(tokens, width, dtype)], 1)
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -20.0, -1.0, 0.0, 1.0, 20.0, 90.0], dtype=dtype)  # saturating gates
    yq, ys = silu_mul_quant(gate_up, max_block=max_block)
    ref_q, ref_s = fn.dynamic_quant(fn.silu_mul(gate_up.cpu()), 0)
    assert yq.shape == (tokens, width)
    assert_fp8_close(yq, ref_q, _rare(yq.numel()))
    _check_scales(ys, ref_s, exact=False)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "width", "max_block"), SHAPES)
def test_silu_mul_matches_reference(dtype, tokens, width, max_block):
    """Unquantized: each op rounded to the model dtype as torch rounds it; the sigmoid's exp may
    differ in its last fp32 bit from torch's, moving a rare bf16 value by one ulp (fp32: a few ulps).
    Results below bf16's smallest normal (a gate near -85 times a tiny up: ~1e-39) are subnormal,
    which the kernel's cast may flush or round otherwise than torch's (9% of runs of this shape had
    such a value): those agree within that smallest normal and are not counted as differing."""
    gate_up = torch.cat([_rows(tokens, width, dtype), _rows(tokens, width, dtype)], 1)
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -20.0, -1.0, 0.0, 1.0, 20.0, 90.0], dtype=dtype)
    y = silu_mul(gate_up, max_block=max_block)
    ref = fn.silu_mul(gate_up.cpu())
    assert y.dtype == dtype and y.shape == (tokens, width)
    y = y.cpu()
    if dtype == torch.float32:  # no rounding to hide the two exps' differences
        # the GPU's exp is exp2(g * log2(e)): rounding that product moves exp(g) by up to ~|g| * 2^-24 of
        # itself (1.7e-6 relative seen at H200, rtol 1e-6 failed), the interpreter's numpy exp by an ulp
        gate = gate_up[:, :width].cpu().abs()
        bound = ref.abs() * (1 + gate) * 2.0**-21 + 1e-30
        worst = ((y - ref).abs() / bound).max()
        assert worst <= 1, f"{float(worst):.3g} of the bound"
        return
    tiny = torch.finfo(dtype).tiny
    differ = (y != ref) & (ref.float().abs() >= tiny)
    assert int(differ.sum()) <= _rare(y.numel()), f"{int(differ.sum())} of {y.numel()} differ"
    ulp = (ref.float().abs() * 2.0**-7).clamp(min=tiny)  # bf16; a subnormal result within the smallest normal
    assert ((y.float() - ref.float()).abs() <= ulp).all()


def test_silu_mul_quant_rejects_odd_width():
    with pytest.raises(ValueError):
        silu_mul_quant(torch.ones(2, 9, dtype=torch.bfloat16, device=DEVICE))
