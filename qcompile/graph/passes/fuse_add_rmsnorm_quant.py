"""fuse_add_rmsnorm_quant: residual Add -> RMSNormalization [-> DynamicQuant] -> AddRMSNorm[Quant]."""

from __future__ import annotations

from qcompile.graph.ir import Graph, Node
from qcompile.graph.ops import DOMAIN
from qcompile.graph.passes.base import GraphPass
from qcompile.graph.rewrite import Rewrite

NAME = "fuse_add_rmsnorm_quant"


def fuse_add_rmsnorm_quant(graph: Graph) -> Graph:
    """Fold each hidden-state RMSNormalization ([T,H], not the per-head q/k norms) with the residual Add
    that feeds it, and with the DynamicQuant that is its only reader, into AddRMSNorm / AddRMSNormQuant.

    A norm with no Add before it (the first layer's) becomes the fused op with the residual absent; its
    `residual_out` (= x) then replaces x for every later reader, so the residual stream runs through it.
    """
    rw = Rewrite(graph)
    for index, norm in enumerate(graph.nodes):
        if not norm.is_op("RMSNormalization") or rw.type_of(norm.inputs[0]).rank != 2:
            continue
        x_in, weight = norm.inputs[0], norm.inputs[1]
        add = rw.producer_of(x_in, "Add")
        if add is not None and all(rw.type_of(v).rank == 2 for v in rw.node(add).inputs):
            x, residual = rw.node(add).inputs
            residual_out, at = x_in, add
            rw.remove([add])
        else:
            x, residual, residual_out, at = x_in, "", f"{x_in}.residual", index
            rw.rename_uses(x_in, residual_out, after=index)
        (y,) = norm.outputs
        eps = norm.attrs["epsilon"]
        quant = rw.sole_user(y, "DynamicQuant")
        types = {residual_out: rw.type_of(x_in)}
        if quant is not None:
            dq = rw.node(quant)
            fused = Node(
                "AddRMSNormQuant",
                DOMAIN,
                (x, residual, weight),
                (*dq.outputs, residual_out),
                {"epsilon": eps, "group_size": dq.attrs["group_size"]},
                norm.name,
            )
            rw.remove([quant])
        else:
            fused = Node("AddRMSNorm", DOMAIN, (x, residual, weight), (y, residual_out), {"epsilon": eps}, norm.name)
        rw.remove([index])
        rw.insert(at, fused, types)
    return rw.apply() if rw.changed else graph


PASS = GraphPass(NAME, fuse_add_rmsnorm_quant)
