"""The graph passes, one file each, in a read-only registry looked up by the names recipes list."""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

from qcompile.errors import PlanError
from qcompile.graph.ir import Graph, check_graph
from qcompile.graph.passes import (
    fuse_add_rmsnorm_quant,
    fuse_allreduce_add_rmsnorm,
    fuse_gate_up_proj,
    fuse_moe_experts,
    fuse_qknorm_rope_kvwrite,
    fuse_qkv_proj,
    fuse_silu_mul_quant,
)
from qcompile.graph.passes.base import GraphPass

PASSES = MappingProxyType(
    {
        p.name: p
        for p in (
            fuse_qkv_proj.PASS,
            fuse_gate_up_proj.PASS,
            fuse_moe_experts.PASS,
            fuse_add_rmsnorm_quant.PASS,
            fuse_allreduce_add_rmsnorm.PASS,
            fuse_silu_mul_quant.PASS,
            fuse_qknorm_rope_kvwrite.PASS,
        )
    }
)


def apply_passes(graph: Graph, names: Sequence[str]) -> Graph:
    """Run the named passes in order; the result records them in `applied_passes`.

    Raises PlanError for an unknown pass, a pass listed twice or already applied, or a pass whose
    required passes have not been applied before it.
    """
    for name in names:
        if name not in PASSES:
            raise PlanError(f"unknown graph pass {name!r}; known: {', '.join(PASSES)}")
        graph_pass = PASSES[name]
        if name in graph.applied_passes:
            raise PlanError(f"pass {name!r} is applied twice; list it once in the recipe's passes")
        missing = [req for req in graph_pass.requires if req not in graph.applied_passes]
        if missing:
            raise PlanError(
                f"pass {name!r} needs {', '.join(repr(m) for m in missing)} applied before it; put "
                f"{missing[0]!r} earlier in the recipe's passes, or remove {name!r}"
            )
        graph = graph_pass(graph)
        check_graph(graph)
        graph = graph.replace(applied_passes=(*graph.applied_passes, name))
    return graph


__all__ = ["PASSES", "GraphPass", "apply_passes"]
