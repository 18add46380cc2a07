"""The fused MoE with W4A16 experts (kernels/fused_moe_w4a16.py: int4 expert GEMMs, grouped and
one-token GEMVs) and the fast-path MoE op that runs it, against the reference MoE op over the same
packed int4 weights (qruntime.ops.moe: per-expert dequantization then a Gemm in the model dtype).
Interpreter on CPU, native on a GPU; every int32 bit pattern is a valid row of codes, so the weights
are random words, the scales random per group, the zero points random codes.

Both paths round the weights, h, SiLU-mul and each weighted row to the model dtype at the same
points; only fp32 summation order differs (the dot's, and the k rows added in fp32 by the kernel,
in bf16 by the reference), so outputs agree to the last bit but for rare roundings of an ulp or
two. A wrong nibble, scale group or zero point moves whole rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from int4_shapes import INT4_SHAPES
from moe_plans import reference_and_fast_plans
from qruntime.kernel_configs import KernelTable
from qruntime.kernels import fused_moe_w4a16 as fused
from qruntime.kernels.fused_moe import MoEConfig, TileConfig, table_key
from qruntime.kernels.moe_combine import PairRows
from qruntime.kernels.moe_gemv import GemvTile, MoEGemvConfig
from qruntime.ops import moe, triton_ops
from qruntime.ops.base import OpEnv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def int4_experts(num_experts: int, inter: int, hidden: int, group: int, zero_point: bool, dtype: torch.dtype):
    """Fresh random int4 experts (w13, w13_scale, w2, w2_scale[, w13_zp, w2_zp]) on the CPU."""
    out, zps = [], []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):
        out.append(torch.randint(-(1 << 31), 1 << 31, (num_experts, rows, cols // 8), dtype=torch.int64).int())
        out.append((torch.rand(num_experts, rows, cols // group) * 0.04 + 0.01).to(dtype))
        zps.append(torch.randint(0, 16, (num_experts, rows, cols // group), dtype=torch.uint8))
    return tuple(out + zps) if zero_point else tuple(out)


def untied_router(x: torch.Tensor, num_experts: int, top_k: int) -> torch.Tensor:
    """Router rows under which each token's k-th logit beats the next by a margin: at a near-tie
    the kernel's logits (another summation order) may pick the other expert."""
    for _ in range(200):
        router_w = (torch.randn(num_experts, x.shape[-1]) * 0.3).to(x.dtype)
        top = F.linear(x, router_w).float().topk(top_k + 1, -1).values
        if bool((top[:, top_k - 1] - top[:, top_k] > 0.1).all()):
            return router_w
    raise AssertionError("no router without near-ties")


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    _, e = torch.frexp(x.float().abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e - (8 if dtype == torch.bfloat16 else 11))


def _ops(num_experts: int, top_k: int, group: int, dtype: torch.dtype, kernels: KernelTable | None = None):
    attrs = {"num_experts": num_experts, "top_k": top_k, "norm_topk_prob": True, "linear": "W4A16Linear"}
    attrs["group_size"] = group
    ref = moe.MoE(attrs, OpEnv(dtype, torch.device("cpu"), None))
    fast = triton_ops.MoE(attrs, OpEnv(dtype, torch.device(DEVICE), None, kernels))
    return ref, fast


# tokens, H, I, group, zero points, dtype, config: K tiles inside a group and over whole groups,
# K tails (I = 96 in 64-wide steps), I and H past the column tiles
CASES = [
    (1, 64, 96, 32, False, torch.bfloat16, MoEGemvConfig(GemvTile(8, 64, 2), GemvTile(16, 64, 1))),
    (1, 128, 64, 64, True, torch.bfloat16, MoEGemvConfig(GemvTile(4, 32, 1), GemvTile(32, 128, 2))),
    (9, 64, 96, 32, False, torch.bfloat16, MoEConfig(16, TileConfig(32, 64, 4, 2), TileConfig(32, 64, 4, 2))),
    (9, 128, 64, 64, True, torch.float16, MoEConfig(16, TileConfig(16, 32, 4, 2), TileConfig(32, 128, 4, 2))),
]


@pytest.mark.parametrize(("tokens", "hidden", "inter", "group", "zero_point", "dtype", "config"), CASES)
def test_w4a16_moe_op_runs_the_kernel_and_matches_the_reference_op(
    tokens, hidden, inter, group, zero_point, dtype, config
):
    """T = 1 on the GEMVs (the router GEMV fused into the routing launch), T = 9 on the grouped
    GEMMs; symmetric and zero-point experts."""
    num_experts, top_k = 8, 2
    weights = int4_experts(num_experts, inter, hidden, group, zero_point, dtype)
    x = torch.randn(tokens, hidden).to(dtype)
    router_w = untied_router(x, num_experts, top_k)
    ref_op, fast_op = _ops(num_experts, top_k, group, dtype)
    assert fast_op.kernel is fused.fused_moe_w4a16 and fast_op.capturable and not ref_op.capturable
    fast_op.configs[tokens] = config
    ref = ref_op(None, x, router_w, *weights)
    y = fast_op(None, x.to(DEVICE), router_w.to(DEVICE), *(w.to(DEVICE) for w in weights)).cpu()
    assert y.dtype == dtype and y.shape == (tokens, hidden)
    assert ref.abs().amax() > 0.1  # a real signal, not rounding noise
    # in ulps of each element, or of a sixteenth of its row's largest where the down GEMM's sum
    # cancelled to less: a one-ulp flip of h or act (summation order, or torch's sigmoid against
    # tl.exp) moves an output by about the row's rounding, which is many ulps of an element that
    # cancelled near zero (seen: 8 ulps of -0.0098 in a row reaching 17, fp16, torch seed 308278443);
    # fp16 is 8x finer than bf16: over 61 torch seeds of the fp16 zero-point case, 4 ulps once (seed
    # 407203950) and up to 1.1% of the elements apart (seeds 37, 49), so fp16 may reach 8 ulps and 3%.
    # A wrong nibble moves whole rows (128 elements, 11% of the 9 x 128), by far more.
    floor = ref.float().abs().amax(-1, keepdim=True) / 16
    apart = (y.float() - ref.float()).abs() / ulp(
        torch.maximum(torch.maximum(y.abs(), ref.abs()).float(), floor), dtype
    )
    limit, share = (8, 0.03) if dtype == torch.float16 else (2, 0.01)
    assert float(apart.max()) <= limit and float((apart > 0).float().mean()) <= share, float(apart.max())


def test_a_w4a16_moe_graph_binds_the_kernel(make_ckpt, compiled, rng, monkeypatch):
    """tiny-moe compiled w4a16 (8 experts of 256, hidden 128, groups of 128), bound to the fast op
    table: its MoE nodes run the int4 kernel, not the reference, so nothing in the plan keeps it out
    of CUDA graphs; a node on the artifact's own weights gives the reference node's output."""
    artifact = compiled(make_ckpt("tiny-moe", **INT4_SHAPES, moe_intermediate_size=256), "w4a16")
    weights, ref_plan, fast_plan, nodes = reference_and_fast_plans(artifact, DEVICE)
    assert not ref_plan.capturable and fast_plan.capturable
    assert len(nodes) == 2 and all(f.op.kernel is fused.fused_moe_w4a16 for _, f in nodes)
    ref_node, fast_node = nodes[1]
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    x = torch.randn(3, 128, generator=generator).to(DEVICE, torch.bfloat16)
    fast_node.op.configs[3] = MoEConfig(16, TileConfig(128, 128, 4, 1), TileConfig(128, 128, 4, 1))  # few programs
    args = [weights[name] for name in ref_node.inputs[1:] if name]
    router_w = untied_router(x.cpu(), 8, ref_node.op.a["top_k"])
    args[0] = router_w.to(DEVICE)  # the synthetic router's logits tie in bf16 too often
    ref, y = ref_node.op(None, x, *args), fast_node.op(None, x, *args)
    # ulps of the larger value, at least of a quarter of the row's largest: where the k experts' rows
    # cancel near zero, the sums' orders differ by a fraction of the addends' ulp, not the result's
    # (torch seed 474440472, rng seed 829709372: 3.8e-5 against 2.3e-5 in a row reaching 0.014)
    floor = ref.float().abs().amax(-1, keepdim=True) / 4
    apart = (y.float() - ref.float()).abs() / ulp(
        torch.maximum(torch.maximum(y.abs(), ref.abs()).float(), floor), torch.bfloat16
    )
    assert float(apart.max()) <= 2 and float((apart > 0).float().mean()) <= 0.01, float(apart.max())
    # with the fold turned on (PAIR_ROWS_READERS, off by default), the residual add + norm after
    # each MoE node adds its k rows itself
    monkeypatch.setattr(triton_ops, "PAIR_ROWS_READERS", (triton_ops.AddRMSNorm, triton_ops.AddRMSNormQuant))
    triton_ops.fold_split_k_reductions(fast_plan)
    assert all(f.op.defer_combine for _, f in nodes)
    rows = fast_node.op(None, x, *args)
    assert isinstance(rows, PairRows) and torch.equal(rows.reduce(), y)


def test_the_fast_op_falls_back_where_the_kernel_does_not_apply_and_reads_its_own_table_key():
    _, fast = _ops(8, 2, 32, torch.bfloat16)
    assert fast.kernel is fused.fused_moe_w4a16
    for group, dtype in ((32, torch.float32), (24, torch.bfloat16)):  # an fp32 model; no K tile fits 24
        _, other = _ops(8, 2, group, dtype)
        assert other.kernel is None and not other.capturable
    # an int4 layer reads its own key: an FP8 record of the same E, 2I, H, k is not its config
    w13 = torch.zeros(8, 192, 64 // 8, dtype=torch.int32)  # E 8, I 96, H 64
    tuned = MoEConfig(32, TileConfig(16, 64, 2, 3), TileConfig(64, 32, 8, 5))
    fp8_record = MoEConfig(64, TileConfig(64, 128, 4, 3), TileConfig(64, 128, 4, 3)).to_dict()
    key = fused.table_key(8, 192, 64, 2, 32, False)
    assert key != table_key(8, 192, 64, 2) and key != fused.table_key(8, 192, 64, 2, 32, True)
    entries = {key: {"4": tuned.to_dict() | {"us": 1.5}}, table_key(8, 192, 64, 2): {"4": fp8_record}}
    table = KernelTable.from_dict({"device": "GPU X", "entries": entries}, "t")
    _, fast = _ops(8, 2, 32, torch.bfloat16, kernels=table)
    assert fast._config(3, w13) == tuned and fast._config(9, w13) == tuned
    _, fresh = _ops(8, 2, 32, torch.bfloat16, kernels=table)
    assert fresh._config(3, w13, zero_points=True) == fused.default_config(3, 8, 96, 64, 2)  # the -zp key: untuned


def test_fused_moe_w4a16_checks_its_inputs():
    w13, s13, w2, s2, z13, z2 = (t.to(DEVICE) for t in int4_experts(4, 32, 64, 32, True, torch.bfloat16))
    x = torch.randn(2, 64, device=DEVICE, dtype=torch.bfloat16)
    logits = torch.randn(2, 4, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        fused.fused_moe_w4a16(x.float(), logits, w13, s13, w2, s2, 2, True, group_size=32)
    with pytest.raises(ValueError, match=r"w13_scale must be float \[4, 64, 2\]"):
        fused.fused_moe_w4a16(x, logits, w13, s13[..., :1], w2, s2, 2, True, group_size=32)
    with pytest.raises(ValueError, match=r"w2 must be int32 \[E, 64, 4\]"):
        fused.fused_moe_w4a16(x, logits, w13, s13, w2.view(torch.float32), s2, 2, True, group_size=32)
    with pytest.raises(ValueError, match="w2_zero_point must be uint8"):
        fused.fused_moe_w4a16(x, logits, w13, s13, w2, s2, 2, True, group_size=32, w13_zp=z13, w2_zp=z2.int())
    with pytest.raises(ValueError, match="come together"):
        fused.fused_moe_w4a16(x, logits, w13, s13, w2, s2, 2, True, group_size=32, w13_zp=z13)
    with pytest.raises(ValueError, match="disagree"):
        fused.fused_moe_w4a16(x, logits[:, :3], w13, s13, w2, s2, 2, True, group_size=32)
    assert fused.fused_moe_w4a16(x[:0], logits[:0], w13, s13, w2, s2, 2, True, group_size=32).shape == (0, 64)


@pytest.mark.parametrize("tokens", [1, 8, 64, 1024])
def test_configs_round_trip_and_default_comes_first(tokens):
    cands = fused.sweep_configs(tokens, 128, 768, 2048, 8)
    assert cands[0] == fused.default_config(tokens, 128, 768, 2048, 8)
    assert len(set(cands)) == len(cands) >= 4
    key = fused.table_key(128, 1536, 2048, 8, 128, False)
    for config in cands:
        record = config.to_dict() | {"us": 3.0}
        KernelTable.from_dict({"device": "d", "entries": {key: {"1": record}}}, "t")  # the table's checks
        assert type(config).from_dict(record) == config
