"""fuse_silu_mul_quant: Split/Sigmoid/Mul/Mul [-> DynamicQuant] over a fused gate_up -> SiluMul[Quant]."""

from __future__ import annotations

from qcompile.graph.ir import Graph, Node
from qcompile.graph.ops import DOMAIN
from qcompile.graph.passes.base import GraphPass
from qcompile.graph.rewrite import Rewrite

NAME = "fuse_silu_mul_quant"


def fuse_silu_mul_quant(graph: Graph) -> Graph:
    """Replace gate, up = Split(gate_up); gate * Sigmoid(gate) * up [then DynamicQuant, its only reader]
    by SiluMul(gate_up) or SiluMulQuant(gate_up)."""
    rw = Rewrite(graph)
    for index, split in enumerate(graph.nodes):
        match = _match(rw, index, split)
        if match is None:
            continue
        y, name = rw.node(match[-1]).outputs[0], rw.node(match[-1]).name
        quant = rw.sole_user(y, "DynamicQuant")
        if quant is not None:
            dq = rw.node(quant)
            fused = Node(
                "SiluMulQuant", DOMAIN, (split.inputs[0],), dq.outputs, {"group_size": dq.attrs["group_size"]}, name
            )
            match.append(quant)
        else:
            fused = Node("SiluMul", DOMAIN, (split.inputs[0],), (y,), {}, name)
        rw.remove(match)
        rw.insert(index, fused)
    return rw.apply() if rw.changed else graph


def _match(rw: Rewrite, index: int, split: Node) -> list[int] | None:
    """Indices [split, sigmoid, mul, mul] of a SiLU-and-multiply over a two-way equal Split, else None."""
    if not split.is_op("Split") or len(split.outputs) != 2 or split.attrs.get("axis") != -1:
        return None
    sizes = rw.constant(split.inputs[1]) if len(split.inputs) > 1 else None
    if sizes is None or len(sizes) != 2 or sizes[0] != sizes[1]:
        return None
    gate, up = split.outputs
    sig = next((i for i in rw.users(gate) if rw.node(i).is_op("Sigmoid")), None)
    if sig is None or len(rw.users(gate)) != 2:
        return None
    silu = rw.sole_user(rw.node(sig).outputs[0], "Mul")
    if silu is None or sorted(rw.node(silu).inputs) != sorted((gate, rw.node(sig).outputs[0])):
        return None
    if rw.users(gate) != sorted((sig, silu)):
        return None
    mul = rw.sole_user(rw.node(silu).outputs[0], "Mul")
    if mul is None or set(rw.node(mul).inputs) != {rw.node(silu).outputs[0], up} or rw.users(up) != [mul]:
        return None
    if any(v in rw.graph.outputs for v in (gate, up)):
        return None
    return [index, sig, silu, mul]


PASS = GraphPass(NAME, fuse_silu_mul_quant, requires=("fuse_gate_up_proj",))
