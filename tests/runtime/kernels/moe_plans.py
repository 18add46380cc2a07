"""A compiled artifact's graph bound twice, to the reference op table and to the fast (Triton) one,
in bf16: the MoE kernel tests compare the two plans' MoE nodes."""

from __future__ import annotations

from pathlib import Path

import onnx
import torch
from qruntime.artifact import read_manifest
from qruntime.kv_cache import KVCacheSpec
from qruntime.ops import moe
from qruntime.ops.base import OpEnv
from qruntime.ops.registry import reference_ops
from qruntime.ops.registry import triton_ops as triton_ops_table
from qruntime.plan import Plan
from qruntime.weights import load_initializers


def reference_and_fast_plans(artifact: Path, device: str) -> tuple[dict, Plan, Plan, list]:
    """(weights, reference plan, fast plan, [(reference node, fast node)] of the MoE nodes in order)."""
    graph = onnx.load(str(artifact / "graph.onnx"), load_external_data=False).graph
    spec = KVCacheSpec.from_manifest(read_manifest(artifact)["kv_cache"])
    weights = load_initializers(artifact, graph, torch.device(device), torch.bfloat16)
    env = OpEnv(torch.bfloat16, torch.device(device), spec)
    ref_plan, fast_plan = (Plan.build(graph, weights, env, table) for table in (reference_ops(), triton_ops_table()))
    nodes = [(r, f) for r, f in zip(ref_plan.nodes, fast_plan.nodes, strict=True) if isinstance(r.op, moe.MoE)]
    return weights, ref_plan, fast_plan, nodes
