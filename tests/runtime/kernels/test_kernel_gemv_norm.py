"""AddRMSNorm + per-token quantization folded into the next PTPC GEMV (ptpc_fp8_gemv_norm_quant):
the two launches' output and residual_out, bit for bit under the interpreter (on a GPU the sums of
squares may round in another order: the output within a bf16 ulp of it there)."""

from __future__ import annotations

import pytest
import torch
from qruntime.kernels.add_rmsnorm_quant import add_rmsnorm_quant
from qruntime.kernels.fp8_gemm import GemmConfig, ptpc_fp8_gemm, ptpc_fp8_gemv_norm_quant
from test_kernel_fp8_gemm import DEVICE, operands

GEMV = GemmConfig(1, 8, 64, 1, 2, 1)


def _row(k: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(1, k, device=DEVICE) * torch.rand(1, k, device=DEVICE) * 30).to(dtype)


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    if DEVICE == "cpu":
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (got - want).abs().max()
    else:  # the sum of squares' tree: rstd may differ in its last bit
        assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=1e-2 * want.float().abs().max().item())


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "first-layer"])
@pytest.mark.parametrize(
    ("n", "k", "dtype"), [(40, 96, torch.bfloat16), (24, 200, torch.float16), (16, 9000, torch.bfloat16)]
)
def test_gemv_normalizing_its_row_gives_the_two_launches_bits(n: int, k: int, dtype: torch.dtype, residual: bool):
    """k 96 and 200: one tile of the row (masked at 200); 9000: past MAX_BLOCK, the chunked sums."""
    x = _row(k, dtype)
    res = _row(k, dtype) if residual else None
    norm_w = (torch.rand(k, device=DEVICE) + 0.5).to(dtype)
    _, _, w, ws = operands(1, n, k)
    yq, ys, want_ro = add_rmsnorm_quant(x, res, norm_w, 1e-6)
    want = ptpc_fp8_gemm(yq, ys, w, ws, torch.bfloat16, GEMV)
    ro = torch.full_like(x, float("nan")) if residual else x
    got = ptpc_fp8_gemv_norm_quant(x, res, norm_w, 1e-6, ro, w, ws, torch.bfloat16, GEMV)
    _same(got, want)
    assert torch.equal(ro.view(torch.int16), want_ro.view(torch.int16))


def test_bad_operands_are_refused_by_name():
    k = 64
    x, norm_w = _row(k, torch.bfloat16), torch.ones(k, dtype=torch.bfloat16, device=DEVICE)
    _, _, w, ws = operands(1, 16, k)
    ro = torch.empty_like(x)
    with pytest.raises(ValueError, match="residual must be"):
        ptpc_fp8_gemv_norm_quant(x, x[:, :32], norm_w, 1e-6, ro, w, ws, torch.bfloat16, GEMV)
    with pytest.raises(ValueError, match="residual_out must be"):
        ptpc_fp8_gemv_norm_quant(x, x, norm_w, 1e-6, ro.float(), w, ws, torch.bfloat16, GEMV)
    with pytest.raises(ValueError, match="norm_w must be"):
        ptpc_fp8_gemv_norm_quant(x, x, norm_w[:32], 1e-6, ro, w, ws, torch.bfloat16, GEMV)
    with pytest.raises(ValueError, match="GEMV config"):
        ptpc_fp8_gemv_norm_quant(x, x, norm_w, 1e-6, ro, w, ws, torch.bfloat16, GemmConfig(16, 32, 64))


@pytest.mark.parametrize("deferred", ["split-k", "moe-rows"])
def test_a_deferred_x_is_added_up_in_the_gemv_as_the_norm_kernel_adds_it(deferred: str):
    """x left as slices by the GEMM or MoE before the norm (o_proj / down tiles' split-K partials, a
    fused MoE's k weighted expert rows without its combine launch): each GEMV program adds them up
    as add_rmsnorm_quant does, so the folded launch gives that kernel's and the GEMV's bits."""
    from qruntime.kernels.fp8_gemm import SplitKPartials
    from qruntime.kernels.moe_combine import PairRows

    k, n = 96, 40
    if deferred == "split-k":
        xq, xs, w0, ws0 = operands(1, k, 128)
        x = ptpc_fp8_gemm(xq, xs, w0, ws0 * 0.01, torch.bfloat16, GemmConfig(16, 32, 32, 2, 4, 2), defer_reduce=True)
        assert isinstance(x, SplitKPartials) and x.split == 2
    else:
        x = PairRows((torch.randn(4, k, device=DEVICE) * 2).bfloat16(), top_k=4)
    res = _row(k, torch.bfloat16)
    norm_w = (torch.rand(k, device=DEVICE) + 0.5).bfloat16()
    _, _, w, ws = operands(1, n, k)
    yq, ys, want_ro = add_rmsnorm_quant(x, res, norm_w, 1e-6)
    want = ptpc_fp8_gemm(yq, ys, w, ws, torch.bfloat16, GEMV)
    ro = torch.full_like(res, float("nan"))
    _same(ptpc_fp8_gemv_norm_quant(x, res, norm_w, 1e-6, ro, w, ws, torch.bfloat16, GEMV), want)
    assert torch.equal(ro.view(torch.int16), want_ro.view(torch.int16))
    with pytest.raises(ValueError, match="needs a residual"):
        ptpc_fp8_gemv_norm_quant(x, None, norm_w, 1e-6, ro, w, ws, torch.bfloat16, GEMV)
