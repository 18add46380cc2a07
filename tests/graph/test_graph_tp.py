"""Tensor-parallel graphs: each rank's shares in shapes and attributes, two collectives per layer,
the AllReduce fusion pass (a no-op at tp=1), checker-clean ONNX, and binding to the runtime's ops
(which want a process group)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import onnx
import pytest
import torch
from graph_helpers import PASS_NAMES, dense_spec, moe_spec, recipe, write_weights
from qruntime.kv_cache import KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS
from qruntime.ops.base import OpEnv
from qruntime.ops.registry import reference_ops, triton_ops
from qruntime.plan import Plan, PlanError

from qcompile.compile.sharding import Sharding
from qcompile.errors import PlanError as CompilePlanError
from qcompile.graph import apply_passes, build_graph, compile_graph, to_onnx
from qcompile.graph.ops import COLLECTIVE_OPS
from qcompile.source.model import expected_tensors
from qcompile.source.spec import ModelSpec

# 4 query / 2 KV heads: tp=2 splits the KV heads, tp=4 replicates them
SPECS = {
    "dense": dense_spec(num_attention_heads=4, num_key_value_heads=2),
    "moe": moe_spec(num_attention_heads=4, num_key_value_heads=2),
}
CASES = [
    (spec, rec, tp, passes)
    for spec in SPECS
    for rec in ("ptpc-fp8", "bf16", "tensor-fp8")
    for tp in (2, 4)
    for passes in ("all", "none")
]


def _graph(spec: ModelSpec, rec: str, tp: int, passes: tuple[str, ...] = PASS_NAMES):
    return compile_graph(spec, dataclasses.replace(recipe(rec, passes=passes), tp=tp))


def _ops(graph) -> Counter[str]:
    return Counter(node.op_type for node in graph.nodes)


@pytest.mark.parametrize(("spec_name", "rec", "tp", "passes"), CASES)
def test_each_rank_computes_its_share_and_reduces_twice_per_layer(spec_name: str, rec: str, tp: int, passes: str):
    spec = SPECS[spec_name]
    graph = _graph(spec, rec, tp, PASS_NAMES if passes == "all" else ())
    ops, layers = _ops(graph), spec.num_hidden_layers
    assert sum(ops[op] for op in COLLECTIVE_OPS) == 2 * layers
    if passes == "all":
        assert ops["AllReduce"] == 0 and ops["AllReduceAddRMSNorm"] + ops["AllReduceAddRMSNormQuant"] == 2 * layers
    heads, kv_heads, d = 4 // tp, 1, spec.head_dim
    for node in graph.nodes:
        if node.op_type in ("PagedAttention", "QKNormRoPEKVWrite"):
            assert (node.attrs["num_heads"], node.attrs["num_kv_heads"]) == (heads, kv_heads)
        if node.op_type in COLLECTIVE_OPS:  # each reads a rank's partial sum of a row-parallel output
            assert node.inputs[0].endswith((".attn_out.partial", ".mlp_out.partial"))
            assert graph.types[node.inputs[0]].shape == ("T", spec.hidden_size)
    assert graph.types["layers.0.attn"].shape == ("T", heads * d)
    dense = next(i for i in range(layers) if not spec.is_sparse_layer(i))
    up = f"layers.{dense}.mlp.gate_up" if passes == "all" else f"layers.{dense}.mlp.up"
    assert graph.types[up].shape[1] == (2 if passes == "all" else 1) * spec.intermediate_size // tp
    # the initializers are each rank's slices
    shapes, sharding = expected_tensors(spec), Sharding(spec, tp)
    for job in graph.weights.values():
        splits = sharding.splits(job, shapes)
        for out in job.outputs(shapes, graph.model_dtype):
            assert graph.weight_tensors[out.name].shape == splits[out.name].shape(out.shape)


def test_the_allreduce_fusion_is_a_recorded_no_op_at_tp1() -> None:
    without = tuple(p for p in PASS_NAMES if p != "fuse_allreduce_add_rmsnorm")
    for spec in SPECS.values():
        graph = compile_graph(spec, recipe("ptpc-fp8", passes=without))
        after = apply_passes(graph, ["fuse_allreduce_add_rmsnorm"])
        assert after.nodes == graph.nodes and after.applied_passes == (*without, "fuse_allreduce_add_rmsnorm")
        assert not {op for _, op in after.op_types()} & COLLECTIVE_OPS


def test_the_fusion_keeps_the_norms_inputs_and_attributes() -> None:
    rec = dataclasses.replace(recipe("ptpc-fp8"), tp=2)
    unfused_norms = apply_passes(build_graph(SPECS["moe"], rec), [p for p in PASS_NAMES if "allreduce" not in p])
    fused = apply_passes(unfused_norms, ["fuse_allreduce_add_rmsnorm"])
    before = {n.name: n for n in unfused_norms.nodes if n.op_type in ("AddRMSNorm", "AddRMSNormQuant")}
    reduces = {n.outputs[0]: n.inputs[0] for n in unfused_norms.nodes if n.op_type == "AllReduce"}
    after = [n for n in fused.nodes if n.op_type.startswith("AllReduceAdd")]
    assert len(after) == len(reduces) == 6
    for node in after:
        norm = before[node.name]
        assert node.op_type == "AllReduce" + norm.op_type and dict(node.attrs) == dict(norm.attrs)
        assert node.inputs == (reduces[norm.inputs[0]], *norm.inputs[1:]) and node.outputs == norm.outputs
    # the MoE op stops at the collective: it hands on the partial sum
    moe = next(n for n in fused.nodes if n.op_type == "MoE")
    assert moe.outputs == ("layers.0.mlp_out.partial",)


def test_the_fusion_needs_the_add_rmsnorm_fusion_first() -> None:
    graph = build_graph(SPECS["dense"], dataclasses.replace(recipe("ptpc-fp8"), tp=2))
    with pytest.raises(CompilePlanError, match="fuse_allreduce_add_rmsnorm.*fuse_add_rmsnorm_quant"):
        apply_passes(graph, ["fuse_allreduce_add_rmsnorm"])


def _env(graph, tp_group) -> OpEnv:
    spec = graph.spec
    kv = KVCacheSpec(KV_LAYOUTS["nhd"], "bf16", 16, spec.num_hidden_layers, 1, spec.head_dim)
    return OpEnv(graph.model_dtype, torch.device("cpu"), kv, tp_group=tp_group)


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("passes", ["all", "none"])
def test_rank_graphs_pass_the_checker_and_bind_with_a_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op_schemas: None, spec_name: str, passes: str
) -> None:
    graph = _graph(SPECS[spec_name], "ptpc-fp8", 4, PASS_NAMES if passes == "all" else ())
    locations, tensors = write_weights(graph, tmp_path)
    model = to_onnx(graph, locations)
    monkeypatch.chdir(tmp_path)
    onnx.checker.check_model(model, full_check=True, check_custom_domain=True)
    weights = dict(tensors) | {name: torch.from_numpy(array.copy()) for name, array in graph.constants.items()}
    for registry in (reference_ops(), triton_ops()):
        plan = Plan.build(model.graph, weights, _env(graph, tp_group=object()), registry)
        assert sum(type(node.op).__name__ in COLLECTIVE_OPS for node in plan.nodes) == 2 * graph.spec.num_hidden_layers
        with pytest.raises(PlanError, match="tensor-parallel.*load the artifact with tp=N"):
            Plan.build(model.graph, weights, _env(graph, tp_group=None), registry)
