"""qcompile/tune/moe.py without a GPU: the MoE shapes found in a manifest, the table entries the
runtime's fast MoE op reads back, and tune_moe's loop itself (the fused kernel under Triton's
interpreter on CPU, timed by the wall clock instead of CUDA graphs)."""

from __future__ import annotations

import copy

import pytest
import torch
from qruntime.artifact import read_manifest
from qruntime.kernel_configs import KernelTable
from qruntime.kernels.fused_moe import MoEConfig, TileConfig, sweep_configs
from qruntime.ops import triton_ops
from qruntime.ops.base import OpEnv
from wall_timer import wall_timer

from qcompile.errors import QCompileError
from qcompile.tune.moe import MoEShape, moe_shapes, table_entry, tune_moe


def test_moe_shapes_of_a_ptpc_artifact(tiny_moe_ckpt, compiled):
    manifest = read_manifest(compiled(tiny_moe_ckpt, "ptpc-fp8"))
    # tiny-moe: 8 experts of intermediate 32, hidden 64, top 2, renormalised; layers 0 and 2 are sparse
    assert moe_shapes(manifest) == [MoEShape(8, 32, 64, 2, True)]
    assert moe_shapes(manifest)[0].key == "MoE:8x64x64:top2"


def test_moe_shapes_skip_what_the_kernel_does_not_run_and_check_w2(tiny_moe_ckpt, compiled):
    manifest = read_manifest(compiled(tiny_moe_ckpt, "ptpc-fp8"))
    per_tensor = copy.deepcopy(manifest)
    for info in per_tensor["tensors"].values():
        if info["scheme"] == "ptpc-fp8":
            info["scheme"] = "tensor-fp8"  # per-tensor activations: the reference op runs
    assert moe_shapes(per_tensor) == []
    broken = copy.deepcopy(manifest)
    broken["tensors"]["model.layers.2.mlp.experts.w2.weight"]["shape"] = [8, 64, 16]
    with pytest.raises(QCompileError, match="model.layers.2.mlp.experts.w13.weight .* has no matching w2"):
        moe_shapes(broken)


def test_a_table_entry_is_what_the_runtime_op_reads():
    shape = MoEShape(8, 32, 64, 2, True)
    config = MoEConfig(32, TileConfig(64, 128, 4, 4), TileConfig(128, 64, 8, 3))
    entry = table_entry(config.to_dict(), us=12.345, default_us=15.0, sqnr_db=47.26)
    assert entry["us"] == 12.35 and entry["default_us"] == 15.0 and entry["sqnr_db"] == 47.3
    table = KernelTable.from_dict({"device": "GPU X", "entries": {shape.key: {"16": entry}}}, "t.json")
    attrs = {"num_experts": 8, "top_k": 2, "norm_topk_prob": True, "linear": "PTPCLinear", "group_size": 0}
    op = triton_ops.MoE(attrs, OpEnv(torch.bfloat16, torch.device("cpu"), None, table))
    w13 = torch.empty(8, 64, 64, dtype=torch.float8_e4m3fn)
    assert op._config(5, w13) == config


def test_tune_moe_picks_a_candidate_and_checks_it_against_the_reference():
    shape = MoEShape(4, 32, 32, 2, True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: Triton's interpreter
    timed = []
    wall_us = wall_timer(device, timed)

    table = tune_moe(shape, [1], device, wall_us, rotate_bytes=0)
    entry = table["1"]
    assert len(timed) == len(sweep_configs(1, 4, 32, 32, 2)) and set(timed) == {2}  # two weight copies
    assert MoEConfig.from_dict(entry) in sweep_configs(1, 4, 32, 32, 2)
    assert entry["us"] > 0 and entry["default_us"] >= entry["us"] and entry["sqnr_db"] > 30
