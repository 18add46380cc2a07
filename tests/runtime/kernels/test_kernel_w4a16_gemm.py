"""w4a16_gemm against the torch reference w4a16_linear (interpreter on CPU, native on a GPU).

Tolerances: the kernel forms the reference's weight to the bit (q * scale rounded once to the model
dtype) and multiplies it with x accumulating in fp32, in another order than torch's GEMM. Two fp32
sums of the same K products, each within (K - 1) u sum|terms| of the exact one (u = 2^-24, recursive
summation), differ by at most 2 K u sum|terms|: the fp32-output bound. A bf16 / fp16 output rounds
each of them once (to nearest), so they differ by at most one ulp of the larger plus that bound
(which matters where the terms cancel: an output 1e-3 of sum|terms| has fp32 sums that differ by
more than its fp16 ulp)."""

from __future__ import annotations

import re

import pytest
import torch
from hopper_ptx import hopper_ptx
from qruntime.kernels.fp8_gemm import MAX_GEMV_UNROLL
from qruntime.kernels.w4a16_gemm import (
    W4A16Config,
    default_config,
    gemv_steps,
    supports_group,
    sweep_configs,
    w4a16_gemm,
)
from qruntime.ops.functional import dequantize_int4, w4a16_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # (N, K): qkv, o, gate_up, down


def operands(m: int, n: int, k: int, group: int, dtype: torch.dtype = torch.bfloat16):
    """Fresh random W4A16 operands: every int32 bit pattern (any nibble is a valid code), positive
    scales over a decade, activations of varied row norms."""
    w = torch.randint(-(1 << 31), 1 << 31, (n, k // 8), dtype=torch.int64).to(torch.int32).to(DEVICE)
    ws = (torch.rand(n, k // group, device=DEVICE) * 0.09 + 0.01).to(dtype)
    x = (torch.randn(m, k, device=DEVICE) * (torch.rand(m, 1, device=DEVICE) * 4 + 0.1)).to(dtype)
    return x, w, ws


def zero_points(n: int, k: int, group: int) -> torch.Tensor:
    """Fresh random zero-point codes [N, K/group] over all of 0..15 (8 is symmetric int4's)."""
    return torch.randint(0, 16, (n, k // group), dtype=torch.uint8).to(DEVICE)


def assert_fp32_close(y: torch.Tensor, x, w, ws, group: int, wz=None) -> None:
    weight = dequantize_int4(w, ws.to(x.dtype), group, wz).float()  # the reference's weight, exact in fp32
    ref = x.float() @ weight.T
    bound = x.float().abs() @ weight.abs().T  # [M, N] sum of |terms|
    k = x.shape[1]
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert torch.isfinite(y).all()
    assert ((y - ref).abs() <= 2 * k * 2**-24 * bound + 1e-30).all(), (y - ref).abs().max()
    assert (y - ref).norm() <= 1e-6 * ref.norm()


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` numbers at |x| (normal range): 2^(exponent - mantissa bits)."""
    _, e = torch.frexp(x.float().abs())  # |x| = mantissa * 2^e, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e - 1 - MANTISSA_BITS[dtype])


@pytest.mark.parametrize("block_k", [64, 256])
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(48, 256), (40, 384), (96, 128)])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_matches_reference_fp32(m: int, n: int, k: int, split_k: int, group: int, block_k: int) -> None:
    # 16 x 32 tiles: M and N are not multiples of them (masked rows, N=40 a masked column tile);
    # block_k 64 lies inside a group, 256 holds 2 or 4 whole groups and leaves a K tail at K=384
    # (and K=128 is half a tile); split_k is clamped to the K tiles
    x, w, ws = operands(m, n, k, group)
    y = w4a16_gemm(x, w, ws, group, W4A16Config(16, 32, block_k, split_k, 4, 2), out_dtype=torch.float32)
    assert_fp32_close(y, x, w, ws, group)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("m,n,k,group", [(1, 96, 256, 128), (17, 48, 512, 64), (5, 256, 128, 128), (64, 80, 384, 128)])
def test_matches_reference_within_one_ulp(m: int, n: int, k: int, group: int, split_k: int, dtype) -> None:
    x, w, ws = operands(m, n, k, group, dtype)
    y = w4a16_gemm(x, w, ws, group, W4A16Config(16, 32, 64, split_k, 4, 2))
    ref = w4a16_linear(x, w, ws, group)
    assert y.dtype == dtype and y.shape == ref.shape
    diff = (y.float() - ref.float()).abs()
    sums = 2 * k * 2**-24 * (x.float().abs() @ dequantize_int4(w, ws, group).float().abs().T)
    assert (diff <= ulp(torch.maximum(y.float().abs(), ref.float().abs()), dtype) + sums).all(), diff.max()


@pytest.mark.parametrize("group", [64, 128])
def test_unit_rows_read_back_every_weight_exactly(group: int) -> None:
    """x = the identity: row j of y is column j of the weight, so each code's nibble and each
    group's scale are checked one by one (a wrong nibble order or group is off by whole codes)."""
    k, n = 256, 40
    _, w, ws = operands(1, n, k, group)
    x = torch.eye(k, device=DEVICE, dtype=torch.bfloat16)
    for config in (W4A16Config(16, 32, 64, 1, 4, 2), W4A16Config(32, 16, 256, 2, 4, 2)):
        y = w4a16_gemm(x, w, ws, group, config)
        assert torch.equal(y.T, dequantize_int4(w, ws, group))


def test_weights_at_the_code_extremes() -> None:
    """Words of all 0 (every code -8), all 0xF (7) and 0x8 nibbles (0), with an fp32 scale cast to x's dtype."""
    m, n, k, group = 3, 48, 256, 128
    x, _, _ = operands(m, n, k, group)
    w = torch.tensor([0, -1, 0x88888888 - (1 << 32)], dtype=torch.int32, device=DEVICE)[:, None].repeat(
        16, k // 8
    )  # rows cycle
    ws = torch.rand(n, k // group, device=DEVICE) + 0.5
    y = w4a16_gemm(x, w, ws, group, W4A16Config(16, 16, 128, 2, 4, 2), out_dtype=torch.float32)
    assert_fp32_close(y, x, w, ws, group)
    assert (y[:, 2::3] == 0).all()


def test_strided_rows_and_default_config_split() -> None:
    m, n, k, group = 2, 64, 2048, 128
    cfg = default_config(m, n, k, group)
    assert cfg.split_k > 1  # two N tiles: the default splits K
    x, w, ws = operands(m, n, k, group)
    wide = torch.empty(m, k + 64, device=DEVICE, dtype=x.dtype)
    wide[:, :k] = x
    y = w4a16_gemm(wide[:, :k], w, ws, group, out_dtype=torch.float32)  # row stride k + 64
    assert_fp32_close(y, x, w, ws, group)


def test_empty_token_batch() -> None:
    x, w, ws = operands(0, 32, 128, 128)
    assert w4a16_gemm(x, w, ws).shape == (0, 32)


@pytest.mark.parametrize("group", [128, 64, 32])
@pytest.mark.parametrize("n,k", QWEN3_8B)
@pytest.mark.parametrize("m", [1, 4, 16])
def test_default_config_decode_streams_weight_on_all_sms(m: int, n: int, k: int, group: int) -> None:
    cfg = default_config(m, n, k, group)
    assert cfg.block_m == (1 if m == 1 else 16) and cfg.fits(group)  # one token: the GEMV
    programs = -(-n // cfg.block_n) * cfg.split_k
    assert programs >= 132, (cfg, programs)  # every H100 SM streams part of the weight
    if m == 1:
        block_k, steps = gemv_steps(k, cfg.block_k, group)
        assert k % block_k == 0 and steps <= MAX_GEMV_UNROLL and cfg.split_k == 1
        return
    assert k % (cfg.block_k * cfg.split_k) == 0  # equal K ranges, no masked K tail


@pytest.mark.parametrize("n,k", QWEN3_8B)
@pytest.mark.parametrize("m", [256, 1024, 4096])
def test_default_config_prefill_big_tiles(m: int, n: int, k: int) -> None:
    cfg = default_config(m, n, k)
    assert cfg.block_m >= 64 and cfg.block_n >= 128 and cfg.split_k == 1
    if m >= 1024:  # the weight tile is the dot's first operand, 256 tokens share each unpacked tile
        assert cfg.swap_ab == 1 and cfg.block_m == 256


@pytest.mark.parametrize("group", [128, 48, 8])
@pytest.mark.parametrize("m", [1, 8, 16, 33, 64, 256, 1024, 4096])
def test_sweep_configs(m: int, group: int) -> None:
    for n, k in QWEN3_8B:
        cands = sweep_configs(m, n, k, group)
        assert cands[0] == default_config(m, n, k, group)
        assert 2 <= len(cands) <= 24 and len(set(cands)) == len(cands)
        assert all(c.fits(group) for c in cands)
        assert any(c.swap_ab for c in cands) and any(not c.swap_ab for c in cands if c.block_m > 1)
        assert any(c.packed for c in cands) and any(not c.packed for c in cands if c.block_m > 1)
        gemvs = [c for c in cands if c.block_m == 1]
        # one token: the tuner times GEMVs beside the tiles (not for a group like 48, whose 16-wide
        # steps would unroll K/16 times); more tokens: no GEMV
        assert (len(gemvs) >= 4 and len(gemvs) < len(cands)) if m == 1 and group != 48 else not gemvs


def test_config_json_round_trip_and_validation() -> None:
    cfg = W4A16Config(16, 64, 256, 4, 4, 4)
    assert W4A16Config.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict() == {
        "block_m": 16,
        "block_n": 64,
        "block_k": 256,
        "split_k": 4,
        "num_warps": 4,
        "num_stages": 4,
        "swap_ab": 0,
        "packed": 0,
    }
    with pytest.raises(ValueError, match="block_n"):
        W4A16Config(16, 48, 64)
    with pytest.raises(ValueError, match="split_k"):
        W4A16Config(16, 32, 64, split_k=0)
    # the GEMV (block_m 1), validated as the FP8 GEMV's; swap_ab is 0 or 1, and 0 for a GEMV
    assert W4A16Config(1, 4, 1024, 1, 4, 1).block_m == 1
    for bad, field in (((1, 3, 512), "block_n"), ((1, 512, 512), "block_n"), ((1, 4, 24), "block_k")):
        with pytest.raises(ValueError, match=field):
            W4A16Config(*bad)
    with pytest.raises(ValueError, match="split_k 1"):
        W4A16Config(1, 4, 512, 2)
    with pytest.raises(ValueError, match="swap_ab"):
        W4A16Config(1, 4, 512, swap_ab=1)
    with pytest.raises(ValueError, match="swap_ab"):
        W4A16Config(16, 32, 64, swap_ab=2)
    with pytest.raises(ValueError, match="packed"):
        W4A16Config(1, 4, 512, packed=1)
    with pytest.raises(ValueError, match="packed"):
        W4A16Config(16, 32, 64, packed=-1)
    swapped = W4A16Config(256, 128, 64, 1, 8, 3, 1, 1)
    assert W4A16Config.from_dict(swapped.to_dict()) == swapped and swapped.to_dict()["swap_ab"] == 1
    old_record = {k: v for k, v in cfg.to_dict().items() if k not in ("swap_ab", "packed")}  # a table from before
    assert W4A16Config.from_dict(old_record) == cfg
    assert supports_group(128) and supports_group(48) and supports_group(8) and not supports_group(24)


def test_bad_inputs_raise() -> None:
    m, n, k, group = 3, 32, 256, 128
    x, w, ws = operands(m, n, k, group)
    cases = {
        "x must be bfloat16 or float16": (x.float(), w, ws, group),
        "w must be int32": (x, w.view(torch.float32), ws, group),
        "disagree on K": (x, w[:, :-1], ws, group),
        "2-D": (x[None], w, ws, group),
        "ws must be": (x, w, ws[:, :1], group),
        "group_size must be": (x, w, ws, 24),
        "contiguous rows": (x, w.T.contiguous().T, ws, group),
    }
    for match, args in cases.items():
        with pytest.raises(ValueError, match=match):
            w4a16_gemm(*args)
    with pytest.raises(ValueError, match="out_dtype"):
        w4a16_gemm(x, w, ws, group, out_dtype=torch.int32)
    x48, w48, ws48 = operands(m, n, 192, 48)
    with pytest.raises(ValueError, match="block_k 64 neither divides nor is a multiple of group_size 48"):
        w4a16_gemm(x48, w48, ws48, 48, W4A16Config(16, 32, 64))
    assert_fp32_close(w4a16_gemm(x48, w48, ws48, 48, out_dtype=torch.float32), x48, w48, ws48, 48)


# ------------------------------------------------------------ asymmetric int4: a zero point per group


@pytest.fixture
def fresh_torch(rng) -> None:
    """torch's generator seeded from the printed fresh seed of `rng`: new operands every run."""
    torch.manual_seed(rng.randrange(1 << 30))


@pytest.mark.usefixtures("fresh_torch")
@pytest.mark.parametrize("block_k", [64, 256])
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("n,k", [(40, 384), (96, 128)])
@pytest.mark.parametrize("m", [1, 17])
def test_zero_points_match_reference_fp32(m: int, n: int, k: int, split_k: int, group: int, block_k: int) -> None:
    """(code - z) * scale: the tile inside a group (block_k 64) and whole groups (256, K tail at 384)."""
    x, w, ws = operands(m, n, k, group)
    wz = zero_points(n, k, group)
    y = w4a16_gemm(x, w, ws, group, W4A16Config(16, 32, block_k, split_k, 4, 2), out_dtype=torch.float32, wz=wz)
    assert_fp32_close(y, x, w, ws, group, wz)


@pytest.mark.usefixtures("fresh_torch")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,group", [(1, 96, 256, 128), (17, 48, 512, 64), (5, 80, 384, 128)])
def test_zero_points_within_one_ulp_of_the_reference_op(m: int, n: int, k: int, group: int, dtype) -> None:
    x, w, ws = operands(m, n, k, group, dtype)
    wz = zero_points(n, k, group)
    y = w4a16_gemm(x, w, ws, group, W4A16Config(16, 32, 64, 2, 4, 2), wz=wz)
    ref = w4a16_linear(x, w, ws, group, wz)
    diff = (y.float() - ref.float()).abs()
    sums = 2 * k * 2**-24 * (x.float().abs() @ dequantize_int4(w, ws, group, wz).float().abs().T)
    assert (diff <= ulp(torch.maximum(y.float().abs(), ref.float().abs()), dtype) + sums).all(), diff.max()


@pytest.mark.usefixtures("fresh_torch")
@pytest.mark.parametrize("group", [64, 128])
def test_zero_points_unit_rows_read_back_every_weight_exactly(group: int) -> None:
    """x = the identity: each code, scale and zero point read back one by one, bit for bit; all zero
    points 8 give the symmetric kernel's result, and the reference shifts by z - 8."""
    k, n = 256, 40
    _, w, ws = operands(1, n, k, group)
    wz = zero_points(n, k, group)
    x = torch.eye(k, device=DEVICE, dtype=torch.bfloat16)
    for config in (W4A16Config(16, 32, 64, 1, 4, 2), W4A16Config(32, 16, 256, 2, 4, 2)):
        y = w4a16_gemm(x, w, ws, group, config, wz=wz)
        assert torch.equal(y.T, dequantize_int4(w, ws, group, wz))
        eight = torch.full_like(wz, 8)
        assert torch.equal(w4a16_gemm(x, w, ws, group, config, wz=eight), w4a16_gemm(x, w, ws, group, config))
    q = (dequantize_int4(w, torch.ones_like(ws), group) - dequantize_int4(w, torch.ones_like(ws), group, wz)).float()
    assert torch.equal(q, (wz.float() - 8).repeat_interleave(group, 1))


@pytest.mark.usefixtures("fresh_torch")
def test_bad_zero_points_raise() -> None:
    m, n, k, group = 3, 32, 256, 128
    x, w, ws = operands(m, n, k, group)
    wz = zero_points(n, k, group)
    for bad in (wz.to(torch.int32), wz[:, :1], wz.T.contiguous().T):
        with pytest.raises(ValueError, match="wz must be uint8"):
            w4a16_gemm(x, w, ws, group, wz=bad)


# ------------------------------------------------- one token: the GEMV (block_m 1); swapped tiles (swap_ab)


@pytest.mark.usefixtures("fresh_torch")
@pytest.mark.parametrize("zp", [False, True], ids=["symmetric", "zero-points"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "n,k,group,block_n,block_k",
    [(37, 384, 128, 4, 1024), (37, 384, 64, 16, 128), (33, 512, 128, 8, 64), (21, 264, 8, 4, 256)],
    ids=["whole-groups-k-tail", "whole-groups", "in-group", "group-8-k-tail"],
)
def test_gemv_matches_reference_fp32(n: int, k: int, group: int, block_n: int, block_k: int, dtype, zp: bool) -> None:
    """The one-token GEMV (its own sum order: per column, then across) against the reference's
    weight in fp32: odd N (a masked last program), K of a few groups, steps inside a group or
    holding whole ones, a masked K tail (K=384 in 512-wide steps, 264 in 256-wide)."""
    x, w, ws = operands(1, n, k, group, dtype)
    wz = zero_points(n, k, group) if zp else None
    config = W4A16Config(1, block_n, block_k, 1, 4, 1)
    for fast in (False, True):  # bf16: the fp32 unpacking, then _dequant_pairs_bf16's (fp16 has one)
        y = w4a16_gemm(x, w, ws, group, config, out_dtype=torch.float32, wz=wz, fast=fast)
        assert_fp32_close(y, x, w, ws, group, wz)
        y16 = w4a16_gemm(x, w, ws, group, config, wz=wz, fast=fast)  # the model dtype: the fp32 sum rounded once
        assert y16.dtype == dtype and torch.equal(y16, y.to(dtype))


@pytest.mark.usefixtures("fresh_torch")
def test_gemv_reads_back_every_weight_and_stands_for_tiles_above_one_token() -> None:
    """x = unit rows, one at a time: each code, scale and zero point of the GEMV's weight read back
    bit for bit; a GEMV config at more tokens runs the tiled default (the same values)."""
    k, n, group = 128, 12, 64
    _, w, ws = operands(1, n, k, group)
    wz = zero_points(n, k, group)
    eye = torch.eye(k, device=DEVICE, dtype=torch.bfloat16)
    config = W4A16Config(1, 4, 64, 1, 4, 1)
    cols = torch.cat([w4a16_gemm(eye[j : j + 1], w, ws, group, config, wz=wz) for j in range(0, k, 7)])
    assert torch.equal(cols.T, dequantize_int4(w, ws, group, wz)[:, ::7])
    assert torch.equal(w4a16_gemm(eye[:16], w, ws, group, config, wz=wz).T, dequantize_int4(w, ws, group, wz)[:, :16])


@pytest.mark.usefixtures("fresh_torch")
@pytest.mark.parametrize("zp", [False, True], ids=["symmetric", "zero-points"])
@pytest.mark.parametrize("m,split_k,block_k", [(5, 1, 64), (17, 2, 256), (40, 1, 128)])
def test_swapped_tiles_match_reference_fp32(m: int, split_k: int, block_k: int, zp: bool) -> None:
    """swap_ab: each tile computed as w · xᵀ and stored transposed (masked rows and columns, split-K
    partials, whole groups at block_k 256 with a K tail at 384)."""
    n, k, group = 40, 384, 128
    x, w, ws = operands(m, n, k, group)
    wz = zero_points(n, k, group) if zp else None
    config = W4A16Config(16, 32, block_k, split_k, 4, 2, swap_ab=1)
    y = w4a16_gemm(x, w, ws, group, config, out_dtype=torch.float32, wz=wz)
    assert_fp32_close(y, x, w, ws, group, wz)


@pytest.mark.usefixtures("fresh_torch")
@pytest.mark.parametrize("zp", [False, True], ids=["symmetric", "zero-points"])
@pytest.mark.parametrize(
    "config",
    [W4A16Config(16, 32, 64, 2, 4, 2), W4A16Config(16, 32, 256, 1, 4, 2, 1), W4A16Config(32, 16, 128, 1, 4, 2)],
    ids=["in-group-split", "whole-groups-swapped", "whole-groups"],
)
def test_packed_bf16_unpacking_gives_the_fp32_unpackings_bits(config, zp: bool) -> None:
    """bf16 tiles unpack by _dequant_pairs_bf16 (code | 0x4300 pairs, the interpreter's emulation of
    its bf16x2 FMAs) laid out by _bf16_tile; fast=False takes the fp32 unpacking: the same weight
    tile to the bit, so the same outputs to the bit (a K tail at 384 in 256-wide tiles)."""
    m, n, k, group = 7, 40, 384, 64
    x, w, ws = operands(m, n, k, group)
    wz = zero_points(n, k, group) if zp else None
    fast = w4a16_gemm(x, w, ws, group, config, out_dtype=torch.float32, wz=wz, fast=True)
    assert torch.equal(fast, w4a16_gemm(x, w, ws, group, config, out_dtype=torch.float32, wz=wz, fast=False))
    assert_fp32_close(fast, x, w, ws, group, wz)


# --------------------------------------------------------------- the hardware branch, compiled for sm_90

WAIT, RELEASE = re.compile(r"griddepcontrol\.wait\s*;"), re.compile(r"griddepcontrol\.launch_dependents\s*;")
MEMORY = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:(?:ld|st|atom|red)\.global|cp\.async)", re.MULTILINE)
GEMM_TYPES = {
    "x_ptr": "*bf16",
    "w_ptr": "*i32",
    "s_ptr": "*bf16",
    "z_ptr": "*u8",
    "c_ptr": "*bf16",
    "part_ptr": "*fp32",
} | {
    name: "i32"
    for name in ("M", "N", "K", "stride_xm", "stride_wn", "stride_sn", "stride_zn", "stride_cm", "K_PER_SPLIT")
}


@pytest.mark.parametrize("has_zp", [False, True], ids=["symmetric", "zero-points"])
@pytest.mark.parametrize(
    "tile",
    [(16, 32, 256, 128, 4, 4), (16, 32, 256, 64, 4, 4), (128, 128, 64, 128, 8, 3)],
    ids=["decode", "decode-whole-groups", "prefill"],
)
def test_hopper_build_waits_for_its_inputs_before_reading(tile, has_zp):
    """The GPU branch (hardware casts, bf16 tensor-core dots: mma.sync at 16 rows, wgmma at 128)
    compiles for an H100 with the Triton here; with PDL it waits before its first global access
    and releases the next kernel after, without PDL (each tile, with zero points: one build of
    every tile's code path, each build a separate process) neither is there."""
    block_m, block_n, block_k, group, warps, stages = tile
    fixed = {"GROUP": group, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": 2}
    fixed |= {"GROUP_M": 8, "EVEN_K": True, "HW": True, "HAS_ZP": has_zp}
    ptx = hopper_ptx("qruntime.kernels.w4a16_gemm", "_w4a16_gemm_kernel", GEMM_TYPES, fixed | {"PDL": True}, warps)
    assert len(WAIT.findall(ptx)) == 1 and len(RELEASE.findall(ptx)) == 1
    wait = WAIT.search(ptx).start()
    assert wait < RELEASE.search(ptx).start()
    first_access = MEMORY.search(ptx)
    assert first_access is not None and first_access.start() > wait, f"memory touched before the wait: {first_access}"
    assert ("wgmma" in ptx) == (block_m >= 64) and "cvt.rn.bf16x2.f32" in ptx
    if has_zp:
        plain = hopper_ptx(
            "qruntime.kernels.w4a16_gemm", "_w4a16_gemm_kernel", GEMM_TYPES, fixed | {"PDL": False}, warps
        )
        assert "griddepcontrol" not in plain


def test_hopper_build_of_the_split_k_sum_waits_for_its_inputs_before_reading():
    """The split-K partials' sum (one build: it takes no tile) waits before its first global access."""
    reduce = hopper_ptx(
        "qruntime.kernels.w4a16_gemm",
        "_splitk_sum_kernel",
        {"part_ptr": "*fp32", "c_ptr": "*bf16", "MN": "i32"},
        {"SPLIT_K": 2, "BLOCK": 1024, "HW": True, "PDL": True},
        4,
    )
    assert WAIT.search(reduce).start() < MEMORY.search(reduce).start()


def test_hopper_build_of_the_bf16_gemv():
    """The one-token GEMV's bf16 GPU branch (FAST: _dequant_pairs_bf16's bf16x2 FMAs, zero points)
    compiles for an H100 with the Triton here; with PDL it asks L2 for its weight rows (a prefetch,
    no load) before the wait, and reads nothing before it."""
    types = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "c_ptr": "*bf16"}
    types |= {name: "i32" for name in ("N", "K", "stride_wn", "stride_sn", "stride_zn")}
    fixed = {"GROUP": 128, "NUM_K": 2, "BLOCK_N": 8, "BLOCK_K": 2048, "EVEN_K": True, "HAS_ZP": True}
    fixed |= {"HW": True, "PDL": True, "PREFETCH_K": 1024, "FAST": True}
    ptx = hopper_ptx("qruntime.kernels.w4a16_gemm", "_w4a16_gemv_kernel", types, fixed, 8)
    assert ptx.count("fma.rn.bf16x2") >= 8 and "lop3.b32" in ptx
    wait = WAIT.search(ptx).start()
    assert "prefetch.global.L2" in ptx[:wait]
    assert MEMORY.search(ptx).start() > wait


def test_hopper_build_of_the_packed_swapped_tile():
    """A packed (bf16x2 unpacking) swapped prefill tile compiles for an H100 with the Triton here:
    wgmma with the unpacked weight, the bf16x2 FMAs, the PDL wait before any global access."""
    fixed = {"GROUP": 128, "BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1, "GROUP_M": 8}
    fixed |= {"EVEN_K": True, "HW": True, "HAS_ZP": True, "PDL": True, "SWAP": True, "FAST": True}
    ptx = hopper_ptx("qruntime.kernels.w4a16_gemm", "_w4a16_gemm_kernel", GEMM_TYPES, fixed, 8)
    assert "wgmma" in ptx and "fma.rn.bf16x2" in ptx
    assert MEMORY.search(ptx).start() > WAIT.search(ptx).start()
