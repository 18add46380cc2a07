"""The FP8 GEMM tuner's choice with and without split-K reductions folded into the next kernel: on
CPU (Triton's interpreter) with a timer under which more splits cost more while the GEMM launches
their reduction and less once the next kernel sums the partials, the bucket's entry is a 2-way
split and its "folded" entry a 4-way one, both checked against the reference, valid for the
runtime's table, and the one a folded GEMM op takes."""

from __future__ import annotations

import pytest
import torch
from qruntime.kernel_configs import check_config
from qruntime.kernels import fp8_gemm
from qruntime.kernels.fp8_gemm import GemmConfig, SplitKPartials

from qcompile.tune.gemm import tune_gemm

N, K = 64, 2048  # at one token every tiled candidate splits K in 2 or 4 (few N tiles; K / (2 block_k) >= 4)


def test_the_folded_entry_is_timed_without_the_reduction(monkeypatch):
    launched: list[tuple[GemmConfig, bool]] = []
    real = fp8_gemm.ptpc_fp8_gemm

    def recorded(*args, config=None, defer_reduce=False, **kwargs):
        launched.append((config, defer_reduce))
        return real(*args, config=config, defer_reduce=defer_reduce, **kwargs)

    def timer(calls):
        result = calls[0]()
        config, deferred = launched[-1]
        assert isinstance(result, SplitKPartials) == (deferred and config.block_m > 1)
        if config.block_m == 1:  # the one-token GEMV (no split, nothing to fold): timed out of the race
            return 10.0
        return 1.0 / config.split_k if deferred else float(config.split_k)  # the reduction costs more than it saves

    monkeypatch.setattr(fp8_gemm, "ptpc_fp8_gemm", recorded)
    table = tune_gemm(N, K, [1], torch.device("cpu"), timer=timer, rotate_bytes=0)
    entry = table["1"]
    assert entry["split_k"] == 2 and entry["us"] == 2.0 and "cublaslt_us" not in entry
    assert entry["folded"]["split_k"] == 4 and entry["folded"]["us"] == 0.25
    check_config(f"PTPCLinear:{N}x{K}", entry, "entry")  # the runtime's table accepts it


def test_no_folded_entry_when_folding_changes_nothing(monkeypatch):
    monkeypatch.setattr(fp8_gemm, "ptpc_fp8_gemm", fp8_gemm.ptpc_fp8_gemm)
    table = tune_gemm(N, K, [1], torch.device("cpu"), timer=lambda calls: calls[0]() is None or 1.0, rotate_bytes=0)
    assert "folded" not in table["1"]  # every candidate times the same: the same winner both ways


@pytest.mark.parametrize(
    ("folded", "match"),
    [({"backend": "triton", "block_m": 16, "block_n": 24}, r"entry\.folded\.block_n"), ({"folded": {}}, "another")],
)
def test_a_bad_folded_entry_is_refused(folded, match):
    entry = {"backend": "cublaslt", "folded": folded}
    with pytest.raises(ValueError, match=match):
        check_config("PTPCLinear:64x64", entry, "entry")


def test_a_folded_gemm_op_takes_the_folded_entry():
    from qruntime.kernel_configs import KernelTable
    from qruntime.ops.base import OpEnv
    from qruntime.ops.triton_ops import PTPCLinear

    one_pass = GemmConfig(16, 32, 64, 1, 4, 2).to_dict()
    split = GemmConfig(16, 32, 64, 4, 4, 2).to_dict()
    table = KernelTable("cpu", {f"PTPCLinear:{N}x{K}": ((16, {"backend": "triton", **one_pass, "folded": split}),)})
    w = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    ws = torch.ones(N, 1, dtype=torch.bfloat16)
    ops = [PTPCLinear({}, OpEnv(torch.bfloat16, torch.device("cpu"), None, table), (None, None, w, ws)) for _ in "ab"]
    ops[1].defer_reduce = True
    assert ops[0]._plan(1) == ("triton", GemmConfig.from_dict(one_pass))
    assert ops[1]._plan(1) == ("triton", GemmConfig.from_dict(split))
