"""qcompile/tune/w4a16.py without a GPU: the W4A16 shapes found in a manifest and tune_w4a16's loop
(the kernel under Triton's interpreter on CPU, timed by the wall clock instead of CUDA graphs),
whose table entries the runtime's fast op reads back."""

from __future__ import annotations

import copy

import pytest
import torch
from int4_shapes import INT4_SHAPES
from qruntime.artifact import read_manifest
from qruntime.kernel_configs import KernelTable
from qruntime.kernels.w4a16_gemm import W4A16Config, sweep_configs
from qruntime.ops import triton_ops
from qruntime.ops.base import OpEnv
from wall_timer import wall_timer

from qcompile.errors import QCompileError
from qcompile.tune.w4a16 import table_key, tune_w4a16, w4a16_shapes


def test_w4a16_shapes_of_an_artifact(make_ckpt, compiled):
    manifest = read_manifest(compiled(make_ckpt("tiny", **INT4_SHAPES), "w4a16"))
    # qkv [512, 128] and gate_up [512, 128]; o [128, 256] and down [128, 256]: groups of 128
    assert w4a16_shapes(manifest) == [(128, 256, 128), (512, 128, 128)]
    assert table_key(512, 128) == "W4A16Linear:512x128"
    assert w4a16_shapes(read_manifest(compiled(make_ckpt("tiny", **INT4_SHAPES), "ptpc-fp8"))) == []
    # the tp=2 ranks' slices: qkv and gate_up split by rows, o and down by columns
    tp2 = read_manifest(compiled(make_ckpt("tiny", **INT4_SHAPES), "w4a16", "tp=2"))
    assert w4a16_shapes(tp2) == [(128, 128, 128), (256, 128, 128)]


def test_w4a16_shapes_refuse_two_group_sizes_under_one_key(make_ckpt, compiled, monkeypatch):
    manifest = copy.deepcopy(read_manifest(compiled(make_ckpt("tiny", **INT4_SHAPES), "w4a16")))
    from qcompile.quant import schemes

    other = schemes.QuantScheme("w4a16-g64", schemes.PerGroupInt4(64), None, "W4A16Linear", None)
    monkeypatch.setattr(
        "qcompile.tune.w4a16.get_scheme", lambda name: other if name == "w4a16-g64" else schemes.get_scheme(name)
    )
    name = "model.layers.1.mlp.down_proj.weight_packed"
    manifest["tensors"][name]["scheme"] = "w4a16-g64"
    with pytest.raises(QCompileError, match="two int4 group sizes"):
        w4a16_shapes(manifest)


def test_tune_w4a16_picks_a_candidate_the_runtime_reads_back():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: Triton's interpreter
    n, k, group = 48, 256, 128
    timed = []
    wall_us = wall_timer(device, timed)

    table = tune_w4a16(n, k, group, [1], device, wall_us, rotate_bytes=0)
    entry = table["1"]
    assert len(timed) == len(sweep_configs(1, n, k, group)) and set(timed) == {2}  # two weight copies
    config = W4A16Config.from_dict(entry)
    assert config in sweep_configs(1, n, k, group)
    assert entry["backend"] == "triton" and entry["us"] > 0 and entry["default_us"] >= entry["us"]
    kernels = KernelTable.from_dict({"device": "GPU X", "entries": {table_key(n, k): table}}, "t.json")
    w, ws = torch.zeros(n, k // 8, dtype=torch.int32), torch.ones(n, k // group, dtype=torch.bfloat16)
    op = triton_ops.W4A16Linear(
        {"group_size": group}, OpEnv(torch.bfloat16, torch.device("cpu"), None, kernels), (None, w, ws)
    )
    assert op._config(1) == config
