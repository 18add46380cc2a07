"""ptpc_fp8_gemm against the torch reference ptpc_linear (interpreter on CPU, native on a GPU)."""

from __future__ import annotations

import pytest
import torch
from qruntime.kernel_configs import KernelTable
from qruntime.kernels.dynamic_quant import dynamic_quant
from qruntime.kernels.fp8_gemm import (
    GemmConfig,
    default_config,
    gemv_steps,
    ptpc_fp8_gemm,
    ptpc_fp8_gemv_quant,
    sweep_configs,
)
from qruntime.ops.functional import ptpc_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # (N, K): qkv, o, gate_up, down


def operands(m: int, n: int, k: int, ws_dtype: torch.dtype = torch.bfloat16):
    """Fresh random PTPC operands: fp8 values over most of the e4m3 range, positive scales."""
    xq = (torch.randn(m, k, device=DEVICE) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device=DEVICE) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    xs = torch.rand(m, 1, device=DEVICE) * 0.01 + 1e-3
    ws = (torch.rand(n, 1, device=DEVICE) * 0.01 + 1e-3).to(ws_dtype)
    return xq, xs, w, ws


def assert_fp32_close(y: torch.Tensor, xq, xs, w, ws) -> None:
    """fp32 output: only the summation order differs from the reference, so the error is bounded by
    a few fp32 roundings of sum(|terms|) (1e-5 of it covers K up to a few hundred)."""
    ref = ptpc_linear(xq, xs, w, ws, torch.float32)
    bound = (xq.float().abs() @ w.float().abs().T) * xs * ws.float().T  # [M, N] sum of |terms|
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert torch.isfinite(y).all()
    assert ((y - ref).abs() <= 1e-5 * bound + 1e-30).all(), (y - ref).abs().max()
    assert (y - ref).norm() <= 1e-6 * ref.norm()


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (normal range): 2^(exponent - 7)."""
    _, e = torch.frexp(x.float().abs())  # |x| = mantissa * 2^e, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e - 8)


@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(48, 64), (96, 160), (256, 128)])
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_matches_reference_fp32(m: int, n: int, k: int, split_k: int) -> None:
    # 16x32x64 tiles: M, N and K=160 are not multiples of them (masked rows, columns and K tail);
    # split_k is clamped to the K tiles (K=64 has one, K=160 with split 4 runs 3 splits)
    xq, xs, w, ws = operands(m, n, k)
    y = ptpc_fp8_gemm(xq, xs, w, ws, torch.float32, GemmConfig(16, 32, 64, split_k, 4, 2))
    assert_fp32_close(y, xq, xs, w, ws)


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("m,n,k", [(1, 96, 160), (17, 48, 256), (5, 256, 128)])
def test_matches_reference_bf16_within_one_ulp(m: int, n: int, k: int, split_k: int) -> None:
    xq, xs, w, ws = operands(m, n, k)
    y = ptpc_fp8_gemm(xq, xs, w, ws, torch.bfloat16, GemmConfig(16, 32, 32, split_k, 4, 2))
    ref = ptpc_linear(xq, xs, w, ws, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    diff = (y.float() - ref.float()).abs()
    assert (diff <= bf16_ulp(torch.maximum(y.float().abs(), ref.float().abs()))).all(), diff.max()


def test_long_k_wide_tile_accumulation() -> None:
    """K=4096 through a 64-row tile: on Hopper that is wgmma, whose fp8 products are added at reduced
    precision. With the kernel's fp32 promotion every 128 of K an H100 measured ||err||/||ref|| 1.3e-4
    and max |err| / sum|terms| 1.5e-5 (without it: 1.4e-3 and 4.4e-4); the interpreter and the
    16-row (mma.sync) path are exact fp32 (~2e-7)."""
    m, n, k = 64, 64, 4096
    xq, xs, w, ws = operands(m, n, k)
    y = ptpc_fp8_gemm(xq, xs, w, ws, torch.float32, GemmConfig(64, 64, 128, 1, 4, 3))
    ref = ptpc_linear(xq, xs, w, ws, torch.float32)
    bound = (xq.float().abs() @ w.float().abs().T) * xs * ws.float().T  # [M, N] sum of |terms|
    assert (y - ref).norm() <= 4e-4 * ref.norm()
    assert ((y - ref).abs() <= 8e-5 * bound).all(), ((y - ref).abs() / bound).max()


def test_fp32_weight_scales_and_strided_rows() -> None:
    m, n, k = 6, 80, 96
    xq, xs, w, ws = operands(m, n, k, ws_dtype=torch.float32)
    wide = torch.empty(m, k + 32, device=DEVICE, dtype=torch.float8_e4m3fn)
    wide[:, :k] = xq
    xq_view = wide[:, :k]  # row stride k + 32
    y = ptpc_fp8_gemm(xq_view, xs, w, ws, torch.float32, GemmConfig(16, 32, 32, 2, 4, 2))
    assert_fp32_close(y, xq, xs, w, ws)


def test_default_config_end_to_end_decode_split() -> None:
    m, n, k = 2, 64, 2048
    cfg = default_config(m, n, k)
    assert cfg.split_k > 1  # one N tile: the default splits K
    xq, xs, w, ws = operands(m, n, k)
    assert_fp32_close(ptpc_fp8_gemm(xq, xs, w, ws, torch.float32), xq, xs, w, ws)


@pytest.mark.parametrize(
    "config", [GemmConfig(1, 1, 16, 1, 1, 1), GemmConfig(1, 4, 64, 1, 2, 1), GemmConfig(1, 8, 32, 1, 4, 1)]
)
@pytest.mark.parametrize("n,k", [(48, 64), (96, 160), (37, 1000), (256, 128)])
def test_gemv_matches_reference(n: int, k: int, config: GemmConfig) -> None:
    """The one-token GEMV (block_m 1): N and K off its tiles (masked rows and K tail; K = 1000 at
    block_k 16 unrolls 32 steps of 32), fp32 to summation order, bf16 within one ulp; at three
    tokens its config stands for the tiled default."""
    xq, xs, w, ws = operands(1, n, k)
    assert_fp32_close(ptpc_fp8_gemm(xq, xs, w, ws, torch.float32, config), xq, xs, w, ws)
    y = ptpc_fp8_gemm(xq, xs, w, ws, torch.bfloat16, config)
    ref = ptpc_linear(xq, xs, w, ws, torch.bfloat16)
    diff = (y.float() - ref.float()).abs()
    assert (diff <= bf16_ulp(torch.maximum(y.float().abs(), ref.float().abs()))).all(), diff.max()
    xq, xs, w, ws = operands(3, n, k)
    assert_fp32_close(ptpc_fp8_gemm(xq, xs, w, ws, torch.float32, config), xq, xs, w, ws)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(40, 72), (24, 9000)])  # K = 9000: the row's max over two 8192 tiles
def test_gemv_quantizing_its_row_gives_the_two_launches_bits(n: int, k: int, dtype: torch.dtype) -> None:
    x = (torch.randn(1, k, device=DEVICE) * torch.rand(1, k, device=DEVICE) * 30).to(dtype)
    _, _, w, ws = operands(1, n, k)
    config = GemmConfig(1, 8, 64, 1, 2, 1)
    want = ptpc_fp8_gemm(*dynamic_quant(x), w, ws, torch.bfloat16, config)
    got = ptpc_fp8_gemv_quant(x, w, ws, torch.bfloat16, config)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError, match="one token"):
        ptpc_fp8_gemv_quant(x.repeat(2, 1), w, ws, torch.bfloat16, config)
    with pytest.raises(ValueError, match="GEMV config"):
        ptpc_fp8_gemv_quant(x, w, ws, torch.bfloat16, GemmConfig(16, 32, 64))
    with pytest.raises(ValueError, match="w must be"):
        ptpc_fp8_gemv_quant(x, w[:, :-16], ws, torch.bfloat16, config)


def test_gemv_is_the_one_token_default_and_unrolls_a_bounded_loop() -> None:
    for n, k in QWEN3_8B:
        assert default_config(1, n, k).block_m == 1 and default_config(2, n, k).block_m == 16
        assert sum(c.block_m == 1 for c in sweep_configs(1, n, k)) >= 4
        assert any(c.block_m == 16 for c in sweep_configs(1, n, k))  # the tuner also times the tiles
    assert gemv_steps(4096, 512) == (512, 8)
    assert gemv_steps(1000, 16) == (32, 32) and gemv_steps(12288, 128) == (512, 24)
    assert gemv_steps(40, 1024) == (64, 1)


def test_gemv_configs_are_checked() -> None:
    gemv = GemmConfig(1, 4, 512, 1, 4, 1)
    assert GemmConfig.from_dict(gemv.to_dict()) == gemv
    with pytest.raises(ValueError, match="block_n"):
        GemmConfig(1, 3, 512)
    with pytest.raises(ValueError, match="split_k 1"):
        GemmConfig(1, 4, 512, split_k=2)
    tiled = GemmConfig(16, 32, 256, 2, 4, 4).to_dict()

    def table(record):
        return KernelTable.from_dict({"device": "d", "entries": {"PTPCLinear:64x64": {"1": record}}}, "t")

    table(gemv.to_dict() | {"folded": tiled})  # a GEMV beside the split-K tile its reader would fold
    for bad, match in (({"block_n": 512}, "block_n"), ({"split_k": 2}, "split_k"), ({"block_k": 8}, "block_k")):
        with pytest.raises(ValueError, match=match):
            table(gemv.to_dict() | bad)
    with pytest.raises(ValueError, match=r"folded\.block_n"):
        table(tiled | {"folded": gemv.to_dict() | {"block_n": 3}})


def test_empty_token_batch() -> None:
    xq, xs, w, ws = operands(0, 32, 64)
    assert ptpc_fp8_gemm(xq, xs, w, ws).shape == (0, 32)


@pytest.mark.parametrize("n,k", QWEN3_8B)
@pytest.mark.parametrize("m", [4, 16])
def test_default_config_decode_streams_weight_on_all_sms(m: int, n: int, k: int) -> None:
    cfg = default_config(m, n, k)
    assert cfg.block_m == 16
    programs = -(-n // cfg.block_n) * cfg.split_k
    assert programs >= 132, (cfg, programs)  # every H100 SM streams part of the weight
    assert k % (cfg.block_k * cfg.split_k) == 0  # equal K ranges, no masked K tail
    if n == 4096:  # o and down: too few N tiles alone
        assert cfg.split_k > 1


@pytest.mark.parametrize("n,k", QWEN3_8B)
@pytest.mark.parametrize("m", [256, 1024, 4096])
def test_default_config_prefill_big_tiles(m: int, n: int, k: int) -> None:
    cfg = default_config(m, n, k)
    assert cfg.block_m >= 64 and cfg.block_n >= 128 and cfg.split_k == 1
    if m == 4096:
        assert cfg.block_m * cfg.block_n >= 256 * 128


@pytest.mark.parametrize("m", [1, 8, 16, 33, 64, 256, 1024, 4096])
def test_sweep_configs(m: int) -> None:
    for n, k in QWEN3_8B:
        cands = sweep_configs(m, n, k)
        assert cands[0] == default_config(m, n, k)
        assert 2 <= len(cands) <= 16 and len(set(cands)) == len(cands)


def test_config_json_round_trip_and_validation() -> None:
    cfg = GemmConfig(16, 64, 256, 4, 4, 4)
    assert GemmConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict() == {
        "block_m": 16,
        "block_n": 64,
        "block_k": 256,
        "split_k": 4,
        "num_warps": 4,
        "num_stages": 4,
    }
    with pytest.raises(ValueError, match="block_n"):
        GemmConfig(16, 48, 64)
    with pytest.raises(ValueError, match="split_k"):
        GemmConfig(16, 32, 64, split_k=0)


def test_bad_inputs_raise() -> None:
    m, n, k = 3, 32, 64
    xq, xs, w, ws = operands(m, n, k)
    cases = {
        "float8_e4m3fn": (xq.to(torch.bfloat16), xs, w, ws),
        "float8_e4m3fn ": (xq, xs, w.to(torch.float8_e5m2), ws),
        "disagree on K": (xq, xs, operands(m, n, k + 16)[2], ws),
        "2-D": (xq[None], xs, w, ws),
        "xs must be float32": (xq, xs.to(torch.bfloat16), w, ws),
        "xs must": (xq, xs[:, 0], w, ws),
        "ws must": (xq, xs, w, ws[:-1]),
        "ws must ": (xq, xs, w, ws.to(torch.int32)),
        "contiguous rows": (xq, xs, w.T.contiguous().T, ws),
    }
    for match, args in cases.items():
        with pytest.raises(ValueError, match=match.strip()):
            ptpc_fp8_gemm(*args)
    with pytest.raises(ValueError, match="out_dtype"):
        ptpc_fp8_gemm(xq, xs, w, ws, torch.int32)
