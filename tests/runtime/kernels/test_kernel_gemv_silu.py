"""SiLU-mul + per-token quantization run by the last program of the gate_up GEMV
(ptpc_fp8_gemv_silu_quant): silu_mul_quant of the GEMV's gate_up, bit for bit (on a GPU too: the
tail's arithmetic is elementwise and a max), from FP8 codes or from AddRMSNorm's row folded in; the
counter is zero again after each launch (a captured graph replays it)."""

from __future__ import annotations

import pytest
import torch
from qruntime.kernels.add_rmsnorm_quant import add_rmsnorm_quant
from qruntime.kernels.dynamic_quant import dynamic_quant
from qruntime.kernels.fp8_gemm import GemmConfig, ptpc_fp8_gemm, ptpc_fp8_gemv_silu_quant
from qruntime.kernels.silu_mul_quant import silu_mul_quant
from test_kernel_fp8_gemm import DEVICE, operands

GEMV = GemmConfig(1, 8, 64, 1, 2, 1)


def _bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert got[0].dtype == want[0].dtype and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1].reshape(-1), want[1].reshape(-1))


@pytest.mark.parametrize(("inter", "k", "block_n"), [(40, 96, 8), (4100, 32, 64)])  # 4100: the tail's two chunks
def test_the_last_program_makes_silu_mul_quants_bits(inter: int, k: int, block_n: int):
    config = GemmConfig(1, block_n, 32, 1, 2, 1)
    x = (torch.randn(1, k, device=DEVICE) * torch.rand(1, k, device=DEVICE) * 30).to(torch.bfloat16)
    _, _, w, ws = operands(1, 2 * inter, k)
    ws = ws * 0.05  # gate_up values where SiLU is not flat
    xq, xs = dynamic_quant(x)
    # the reference's gate_up kept alive: the GEMV's own gate_up cannot reuse its memory (and values)
    gate_up = ptpc_fp8_gemm(xq, xs, w, ws, torch.bfloat16, config)
    want = silu_mul_quant(gate_up)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the counter is back at zero: a second launch (a graph replay) is right too
        _bits(ptpc_fp8_gemv_silu_quant(xq, xs, w, ws, torch.bfloat16, config, counter), want)
        assert counter.item() == 0
    assert gate_up.shape == (1, 2 * inter)


def test_with_the_norm_folded_in_too():
    k, inter = 128, 48
    x, res = (torch.randn(1, k, device=DEVICE) * 3).to(torch.bfloat16), torch.randn(1, k, device=DEVICE).bfloat16()
    norm_w = (torch.rand(k, device=DEVICE) + 0.5).bfloat16()
    _, _, w, ws = operands(1, 2 * inter, k)
    yq, ys, want_ro = add_rmsnorm_quant(x, res, norm_w, 1e-6)
    gate_up = ptpc_fp8_gemm(yq, ys, w, ws, torch.bfloat16, GEMV)  # kept alive (above)
    want = silu_mul_quant(gate_up)
    ro = torch.empty_like(x)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    got = ptpc_fp8_gemv_silu_quant(x, None, w, ws, torch.bfloat16, GEMV, counter, norm=(res, norm_w, ro, 1e-6))
    if DEVICE == "cpu":  # on a GPU the norm's sum of squares may round in another order
        _bits(got, want)
    assert torch.equal(ro, want_ro) and counter.item() == 0 and gate_up.shape == (1, 2 * inter)


def test_bad_operands_are_refused_by_name():
    xq, xs, w, ws = operands(1, 32, 64)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="counter must be"):
        ptpc_fp8_gemv_silu_quant(xq, xs, w, ws, torch.bfloat16, GEMV, counter.long())
    with pytest.raises(ValueError, match="even"):
        ptpc_fp8_gemv_silu_quant(xq, xs, w[:31], ws[:31], torch.bfloat16, GEMV, counter)
    with pytest.raises(ValueError, match="GEMV config"):
        ptpc_fp8_gemv_silu_quant(xq, xs, w, ws, torch.bfloat16, GemmConfig(16, 32, 64), counter)
