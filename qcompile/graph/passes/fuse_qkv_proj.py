"""fuse_qkv_proj: q/k/v projections of a layer -> one linear over `self_attn.qkv_proj` + Split."""

from __future__ import annotations

from qcompile.graph.ir import Graph
from qcompile.graph.passes._fusion import fuse_linears
from qcompile.graph.passes.base import GraphPass
from qcompile.graph.rewrite import Rewrite
from qcompile.source import model as hf

NAME = "fuse_qkv_proj"


def fuse_qkv_proj(graph: Graph) -> Graph:
    """Fuse each layer's q_proj, k_proj, v_proj (rows q, then k, then v) into qkv_proj followed by a Split."""
    rw = Rewrite(graph)
    for i in range(graph.spec.num_hidden_layers):
        modules = [hf.attn_proj(i, proj) for proj in ("q_proj", "k_proj", "v_proj")]
        fuse_linears(rw, NAME, i, modules, hf.attn_proj(i, "qkv_proj"), f"layers.{i}.qkv")
    return rw.apply() if rw.changed else graph


PASS = GraphPass(NAME, fuse_qkv_proj)
