"""fuse_gate_up_proj: a dense MLP's gate/up projections -> one linear over `mlp.gate_up_proj` + Split."""

from __future__ import annotations

from qcompile.graph.ir import Graph
from qcompile.graph.passes._fusion import fuse_linears
from qcompile.graph.passes.base import GraphPass
from qcompile.graph.rewrite import Rewrite
from qcompile.source import model as hf

NAME = "fuse_gate_up_proj"


def fuse_gate_up_proj(graph: Graph) -> Graph:
    """Fuse each dense MLP's gate_proj and up_proj (rows gate, then up) into gate_up_proj + Split.

    Sparse (MoE) layers are left to fuse_moe_experts."""
    rw = Rewrite(graph)
    for i in range(graph.spec.num_hidden_layers):
        modules = [hf.mlp_proj(i, "gate_proj"), hf.mlp_proj(i, "up_proj")]
        fuse_linears(rw, NAME, i, modules, hf.mlp_proj(i, "gate_up_proj"), f"layers.{i}.mlp.gate_up")
    return rw.apply() if rw.changed else graph


PASS = GraphPass(NAME, fuse_gate_up_proj)
