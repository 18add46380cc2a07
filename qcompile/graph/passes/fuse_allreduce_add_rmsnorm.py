"""fuse_allreduce_add_rmsnorm: AllReduce -> AddRMSNorm[Quant] -> AllReduceAddRMSNorm[Quant] (tensor parallelism)."""

from __future__ import annotations

from qcompile.graph.ir import Graph, Node
from qcompile.graph.ops import DOMAIN
from qcompile.graph.passes.base import GraphPass
from qcompile.graph.rewrite import Rewrite

NAME = "fuse_allreduce_add_rmsnorm"
FUSED = {"AddRMSNorm": "AllReduceAddRMSNorm", "AddRMSNormQuant": "AllReduceAddRMSNormQuant"}


def fuse_allreduce_add_rmsnorm(graph: Graph) -> Graph:
    """Fold each AllReduce whose only reader is the x input of an AddRMSNorm / AddRMSNormQuant into it:
    AllReduceAddRMSNorm[Quant](partial, residual, w) sums the ranks' partial outputs, then adds the
    residual and normalizes as before (same attributes). A tp=1 graph has no AllReduce: a no-op there."""
    rw = Rewrite(graph)
    for index, reduce in enumerate(graph.nodes):
        if not reduce.is_op("AllReduce"):
            continue
        (summed,) = reduce.outputs
        user = next((u for op in FUSED if (u := rw.sole_user(summed, op)) is not None), None)
        if user is None or rw.node(user).inputs[0] != summed or summed in rw.node(user).inputs[1:]:
            continue
        norm = rw.node(user)
        fused = Node(
            FUSED[norm.op_type], DOMAIN, (reduce.inputs[0], *norm.inputs[1:]), norm.outputs, norm.attrs, norm.name
        )
        rw.remove([index, user])
        rw.insert(user, fused)
    return rw.apply() if rw.changed else graph


PASS = GraphPass(NAME, fuse_allreduce_add_rmsnorm, requires=("fuse_add_rmsnorm_quant",))
