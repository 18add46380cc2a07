"""qcompile/tune/moe.py for int4 experts without a GPU: the W4A16 MoE shapes found in a w4a16
artifact's manifest (their own table keys), and tune_moe's loop over the int4 kernel's candidates
(Triton's interpreter on CPU, timed by the wall clock instead of CUDA graphs)."""

from __future__ import annotations

import copy

import pytest
import torch
from int4_shapes import INT4_SHAPES
from qruntime.artifact import read_manifest
from qruntime.kernel_configs import KernelTable
from qruntime.kernels import fused_moe_w4a16
from qruntime.kernels.fused_moe import config_from_dict
from qruntime.ops import triton_ops
from qruntime.ops.base import OpEnv
from wall_timer import wall_timer

from qcompile.tune.moe import MoEShape, moe_shapes, tune_moe


@pytest.fixture(scope="module")
def w4a16_moe_manifest(make_ckpt, compiled) -> dict:
    # tiny-moe at the int4 test shapes: layers 0 and 2 sparse, 8 experts of 256, hidden 128, top 2
    return read_manifest(compiled(make_ckpt("tiny-moe", **INT4_SHAPES, moe_intermediate_size=256), "w4a16"))


def test_moe_shapes_of_a_w4a16_artifact(w4a16_moe_manifest):
    (shape,) = moe_shapes(w4a16_moe_manifest)
    assert shape == MoEShape(8, 256, 128, 2, True, group_size=128)
    assert shape.key == "MoE:8x512x128:top2:w4a16-g128" == fused_moe_w4a16.table_key(8, 512, 128, 2, 128, False)
    # pre-quantized asymmetric experts (w4a16-zp): the zero points are in the key
    zp = copy.deepcopy(w4a16_moe_manifest)
    for info in zp["tensors"].values():
        if info["scheme"] == "w4a16":
            info["scheme"] = "w4a16-zp"
    assert [s.key for s in moe_shapes(zp)] == ["MoE:8x512x128:top2:w4a16-zp-g128"]
    broken = copy.deepcopy(w4a16_moe_manifest)
    broken["tensors"]["model.layers.2.mlp.experts.w2.weight_packed"]["shape"] = [8, 128, 16]
    with pytest.raises(Exception, match=r"w13.weight_packed .* has no matching w2 \[E, H, I/8\]"):
        moe_shapes(broken)


def test_tune_moe_times_the_int4_candidates_and_checks_the_winner(monkeypatch):
    """Zero-point experts; two candidates (the default GEMVs and the grouped GEMMs' default) keep
    the interpreter's time down: the full list is test_kernel_fused_moe_w4a16's to check."""
    shape = MoEShape(4, 32, 64, 2, True, group_size=32, zero_point=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: Triton's interpreter
    candidates = [fused_moe_w4a16.default_config(1, 4, 32, 64, 2), fused_moe_w4a16.grouped_config(1, 4, 32, 64, 2)]
    monkeypatch.setattr(fused_moe_w4a16, "sweep_configs", lambda *args: candidates)
    timed = []
    wall_us = wall_timer(device, timed)

    table = tune_moe(shape, [1], device, wall_us, rotate_bytes=0)
    entry = table["1"]
    assert timed == [2, 2]  # each candidate, two weight copies
    assert config_from_dict(entry) in candidates
    assert entry["us"] > 0 and entry["default_us"] >= entry["us"] and entry["sqnr_db"] > 30
    # the runtime's MoE op reads the entry back under the int4 key
    table = KernelTable.from_dict({"device": "GPU X", "entries": {shape.key: table}}, "t.json")
    attrs = {"num_experts": 4, "top_k": 2, "norm_topk_prob": True, "linear": "W4A16Linear", "group_size": 32}
    op = triton_ops.MoE(attrs, OpEnv(torch.bfloat16, torch.device("cpu"), None, table))
    assert op._config(1, torch.empty(4, 64, 8, dtype=torch.int32), True) == config_from_dict(entry)
