"""The fast path on a w4a16 artifact: under the Triton interpreter on CPU, every W4A16Linear binds
the W4A16 GEMM kernel and a prefill and a decode step give the reference plan's logits; the op
reads its tuned config from the kernel table and falls back to the reference where the kernel
cannot run."""

from __future__ import annotations

import pytest
import torch
from int4_shapes import INT4_SHAPES
from qruntime.kernel_configs import KernelTable
from qruntime.kernels.w4a16_gemm import W4A16Config, default_config
from qruntime.kv_cache import KVCache
from qruntime.ops import triton_ops
from qruntime.ops.base import OpEnv, StepContext
from qruntime.ops.registry import reference_ops
from qruntime.ops.registry import triton_ops as fast_table
from qruntime.plan import Plan
from test_kernel_fast_plan import load_artifact, two_steps


@pytest.fixture(scope="module")
def w4a16_artifact(make_ckpt, compiled):
    return compiled(make_ckpt("tiny", **INT4_SHAPES), "w4a16")


def test_fast_plan_runs_the_w4a16_kernel_and_matches_the_reference_plan(w4a16_artifact):
    artifact = w4a16_artifact
    graph, spec, weights, env = load_artifact(artifact)
    plans = {
        name: Plan.build(graph, weights, env, table)
        for name, table in (("ref", reference_ops()), ("fast", fast_table()))
    }
    linears = [node.op for node in plans["fast"].nodes if type(node.op) is triton_ops.W4A16Linear]
    assert len(linears) == 4 * spec.num_layers  # qkv, o, gate_up, down of every layer (lm_head stays bf16)
    assert all(op.kernel is not None for op in linears)
    # qkv [(4 + 2 * 2) * 64, 128] and gate_up [2 * 256, 128]; o [128, 4 * 64] and down [128, 256]
    assert {op.key for op in linears} == {"W4A16Linear:512x128", "W4A16Linear:128x256"}
    caches = {name: KVCache(spec, 8, torch.bfloat16, torch.device("cpu")) for name in plans}
    steps = two_steps(artifact, (21, 5))  # a prefill of both, then a decode step
    for feeds, meta in steps:
        logits = {name: plan.run(StepContext(caches[name], meta), feeds).float() for name, plan in plans.items()}
        # the GEMMs agree to a bf16 ulp; the other kernels' bf16 outputs are truncated under the
        # interpreter (~1 ulp on half the elements), which the layers carry to the logits: measured
        # 4e-5 .. 7e-5 relative noise power; a wrong GEMM is ~1
        noise = (logits["fast"] - logits["ref"]).pow(2).mean() / logits["ref"].pow(2).mean()
        assert float(noise) < 1e-3, float(noise)
    used = {m for op in linears for m in op.configs}
    assert used == {26, 2}  # both steps ran the kernel


def test_tuned_config_is_read_and_unusable_ones_fall_back():
    w, ws = torch.zeros(64, 32, dtype=torch.int32), torch.ones(64, 2, dtype=torch.bfloat16)
    tuned = W4A16Config(16, 16, 64, 2, 4, 2)
    table = KernelTable.from_dict(
        {
            "device": "GPU X",
            "entries": {
                "W4A16Linear:64x256": {
                    "4": {"backend": "triton", **tuned.to_dict(), "us": 1.0},
                    "64": {"backend": "triton", **W4A16Config(64, 64, 256, 1).to_dict()},
                }
            },
        },
        "t.json",
    )
    env = OpEnv(torch.bfloat16, torch.device("cpu"), None, table)
    op = triton_ops.W4A16Linear({"group_size": 128}, env, (None, w, ws))
    assert op.kernel is not None and op.key == "W4A16Linear:64x256"
    assert op._config(3) == tuned
    assert op._config(64) == W4A16Config(64, 64, 256, 1)  # 256 holds two whole groups
    # the tuner's one-token GEMV record (block_m 1) loads and is read back
    gemv = W4A16Config(1, 8, 256, 1, 8, 1)
    gemv_table = KernelTable.from_dict(
        {"device": "GPU X", "entries": {"W4A16Linear:64x256": {"1": {"backend": "triton", **gemv.to_dict()}}}}, "t"
    )
    op_gemv = triton_ops.W4A16Linear(
        {"group_size": 128}, OpEnv(torch.bfloat16, torch.device("cpu"), None, gemv_table), (None, w, ws)
    )
    assert op_gemv._config(1) == gemv
    op64 = triton_ops.W4A16Linear({"group_size": 64}, env, (None, w, torch.ones(64, 4, dtype=torch.bfloat16)))
    assert op64._config(3) == tuned
    # a K tile of 64 does not fit groups of 48 (nor the reverse): the heuristic's config runs
    op48 = triton_ops.W4A16Linear({"group_size": 48}, OpEnv(torch.bfloat16, torch.device("cpu"), None, table), ())
    assert op48.kernel is None  # the weight is no initializer: the reference op runs
    w48, ws48 = torch.zeros(64, 24, dtype=torch.int32), torch.ones(64, 4, dtype=torch.bfloat16)
    table48 = KernelTable.from_dict(
        {"device": "GPU X", "entries": {"W4A16Linear:64x192": {"4": {"backend": "triton", **tuned.to_dict()}}}}, "t"
    )
    op48 = triton_ops.W4A16Linear(
        {"group_size": 48}, OpEnv(torch.bfloat16, torch.device("cpu"), None, table48), (None, w48, ws48)
    )
    assert op48._config(3) == default_config(3, 64, 192, 48) != tuned
    x = torch.randn(3, 192, dtype=torch.bfloat16)
    w48 = torch.randint(-(1 << 31), 1 << 31, (64, 24), dtype=torch.int64).to(torch.int32)
    ref = triton_ops.quant.W4A16Linear({"group_size": 48}, env, (None, w48, ws48))(None, x, w48, ws48)
    got = op48(None, x, w48, ws48)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=1e-3)
    # fp32 compute (the reference path's dtype) and groups of 24 (no K tile fits) run the reference op
    f32 = triton_ops.W4A16Linear({"group_size": 128}, OpEnv(torch.float32, torch.device("cpu"), None), (None, w, ws))
    g24 = triton_ops.W4A16Linear(
        {"group_size": 24}, env, (None, torch.zeros(64, 24, dtype=torch.int32), torch.ones(64, 8))
    )
    assert f32.kernel is None and g24.kernel is None


def test_a_kernel_table_with_a_bad_w4a16_config_is_refused():
    config = {**W4A16Config(16, 16, 64, 2, 4, 2).to_dict(), "block_k": 48}
    with pytest.raises(ValueError, match=r"W4A16Linear:64x256.*\['4'\]\.block_k must be a power of two"):
        KernelTable.from_dict({"device": "GPU X", "entries": {"W4A16Linear:64x256": {"4": config}}}, "t.json")
    gemv = W4A16Config(1, 8, 256, 1, 8, 1).to_dict()
    for bad, match in (({"split_k": 2}, "split_k must be a power of two in 1..1"), ({"block_n": 512}, "block_n")):
        with pytest.raises(ValueError, match=rf"\['1'\]\.{match}"):
            KernelTable.from_dict({"device": "GPU X", "entries": {"W4A16Linear:64x256": {"1": gemv | bad}}}, "t.json")
    with pytest.raises(ValueError, match="cublaslt runs PTPCLinear only"):
        KernelTable.from_dict({"device": "X", "entries": {"W4A16Linear:64x256": {"4": {"backend": "cublaslt"}}}}, "t")
