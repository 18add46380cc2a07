"""The collective ops of tensor-parallel rank graphs (qruntime/ops/collective.py and their fast-path
forms): refused without a process group; on two gloo ranks, the sum of the ranks' partial outputs
followed by the reference AddRMSNorm(Quant) (the fast path: the AddRMSNorm kernels under Triton's
interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from qruntime.comm.all_reduce import AllReducer
from qruntime.kv_cache import KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS
from qruntime.ops import functional as fn
from qruntime.ops.base import OpBindError, OpEnv
from qruntime.ops.registry import reference_ops, triton_ops

OPS = ("AllReduce", "AllReduceAddRMSNorm", "AllReduceAddRMSNormQuant")
ATTRS = {"AllReduce": {}, "AllReduceAddRMSNorm": {"epsilon": 1e-6}}
ATTRS["AllReduceAddRMSNormQuant"] = {"epsilon": 1e-6, "group_size": 0}
GROUPED = {"group_size": 16}  # per-group scales: no kernel, the reference op after the all-reduce
TABLES = {"reference": reference_ops, "triton": triton_ops}
CUSTOM = "triton+custom"  # the fast table with the custom all-reduce over peer memory (OpEnv.all_reduce)


def _env(tp_group, all_reduce=None) -> OpEnv:
    kv = KVCacheSpec(KV_LAYOUTS["nhd"], "bf16", 16, 1, 1, 16)
    return OpEnv(torch.bfloat16, torch.device("cpu"), kv, tp_group=tp_group, all_reduce=all_reduce)


@pytest.mark.parametrize("table", list(TABLES))
@pytest.mark.parametrize("op", OPS)
def test_a_collective_without_a_process_group_is_refused(table: str, op: str) -> None:
    with pytest.raises(OpBindError, match="tensor-parallel.*sharded.*load the artifact with tp=N"):
        TABLES[table]()[("qcompile", op)](ATTRS[op], _env(None))


def test_a_rocm_build_sums_through_torch_distributed(monkeypatch) -> None:
    """The peer-memory kernels wait and flag with PTX: on ROCm every message goes through
    torch.distributed (RCCL), decided before any group call or region is made."""
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    reducer = AllReducer.create(None, torch.device("cuda", 0))
    assert reducer.regions is None and reducer.kernel(torch.ones(8, 64, dtype=torch.bfloat16)) is None
    assert "ROCm" in reducer.describe()


def _rank(rank: int, store: str, inputs: dict, out: str) -> None:
    """One gloo rank: every collective op of both tables on this rank's partial sum."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        reducer = AllReducer.create(dist.group.WORLD, torch.device("cpu"))
        envs = {"reference": _env(dist.group.WORLD), "triton": _env(dist.group.WORLD)}
        envs[CUSTOM] = _env(dist.group.WORLD, reducer)
        x, residual, w = inputs["x"][rank], inputs["residual"], inputs["w"]
        # the default policy: this decode-sized message (480 bytes) takes the LL kernel
        results = {"custom_took": reducer.kernel(x) == "ll"}
        for table, make in (*TABLES.items(), (CUSTOM, triton_ops)):
            env = envs[table]
            for op in OPS:
                impl = make()[("qcompile", op)](ATTRS[op], env)
                args = (x.clone(),) if op == "AllReduce" else (x.clone(), residual, w)
                result = impl(None, *args)
                results[(table, op)] = result if isinstance(result, tuple) else (result,)
            grouped = make()[("qcompile", "AllReduceAddRMSNormQuant")](ATTRS["AllReduceAddRMSNormQuant"] | GROUPED, env)
            results[(table, "grouped")] = grouped(None, x.clone(), residual, w)  # the fast table runs the reference
        torch.save(results, out.format(rank))
    finally:
        dist.destroy_process_group()


def test_two_ranks_sum_their_partial_outputs_then_normalize(tmp_path: Path) -> None:
    tokens, hidden = 5, 48
    inputs = {
        "x": torch.randn(2, tokens, hidden).to(torch.bfloat16),  # each rank's partial sum
        "residual": torch.randn(tokens, hidden).to(torch.bfloat16),
        "w": (torch.rand(hidden) + 0.5).to(torch.bfloat16),
    }
    mp.spawn(_rank, args=(str(tmp_path / "store"), inputs, str(tmp_path / "rank{}.pt")), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    summed = inputs["x"][0] + inputs["x"][1]  # two addends: the same in any order
    h = summed + inputs["residual"]
    y = fn.rms_norm(h, inputs["w"], 1e-6)
    want = {
        "AllReduce": (summed,),
        "AllReduceAddRMSNorm": (y, h),
        "AllReduceAddRMSNormQuant": (*fn.dynamic_quant(y, 0), h),
    }
    for results in ranks:
        assert results["custom_took"]
        for table in TABLES:
            for g, w in zip(results[(table, "grouped")], (*fn.dynamic_quant(y, 16), h), strict=True):
                assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), table
        for op in OPS:
            got = results[("reference", op)]
            assert len(got) == len(want[op])
            for g, w in zip(got, want[op], strict=True):
                assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), op
            for table in ("triton", CUSTOM):  # NCCL's path and the custom kernels: the same bits
                fast = results[(table, op)]
                if op == "AllReduce":
                    assert torch.equal(fast[0], summed), table
                    continue
                from qruntime.kernels.add_rmsnorm_quant import add_rmsnorm, add_rmsnorm_quant

                kernel = add_rmsnorm if op == "AllReduceAddRMSNorm" else add_rmsnorm_quant
                for g, w in zip(fast, kernel(summed, inputs["residual"], inputs["w"], 1e-6), strict=True):
                    assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), (table, op)
