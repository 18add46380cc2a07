"""fuse_moe_experts: the unfused sparse MLP of a layer -> one MoE node over stacked expert weights."""

from __future__ import annotations

import heapq

from qcompile.compile.jobs import WeightJob
from qcompile.errors import PlanError
from qcompile.graph.ir import AttrValue, Graph, Node
from qcompile.graph.ops import COLLECTIVE_OPS, DOMAIN
from qcompile.graph.passes._fusion import check_fusable, linear_reading, linear_weight
from qcompile.graph.passes.base import GraphPass
from qcompile.graph.rewrite import Rewrite
from qcompile.quant import QuantScheme
from qcompile.source import model as hf

NAME = "fuse_moe_experts"


def fuse_moe_experts(graph: Graph) -> Graph:
    """Replace each sparse layer's router Gemm, MoERouting and per-expert linears/SiLU/ExpertWeight/Add
    chain by MoE(x, router_w, w13, w13_scale, w2, w2_scale), reading `mlp.experts.w13` (rows gate_e then
    up_e, stacked over experts) and `mlp.experts.w2` (down_e, stacked). Dense models are left as they are."""
    moe = graph.spec.moe
    if moe is None:
        return graph
    rw = Rewrite(graph)
    static = graph.weight_names() | set(graph.constants) | {""}
    for i in range(graph.spec.num_hidden_layers):
        names = [hf.expert_proj(i, e, p) for e in range(moe.num_experts) for p in ("gate_proj", "up_proj", "down_proj")]
        router = graph.weights.get(hf.router(i))
        if router is None or any(name not in graph.weights for name in names):
            continue
        jobs = [graph.weights[name] for name in names]
        experts = [jobs[e : e + 3] for e in range(0, len(jobs), 3)]  # [gate, up, down] of each expert
        if router.quant.quantized:
            raise PlanError(
                f"pass {NAME!r}: layer {i}: the MoE op reads the router {router.name} in the model dtype, but "
                f"the recipe quantizes it ({router.scheme}). Add 're:.*mlp.gate$' to quantization.ignore, "
                f"or remove {NAME!r} from the recipe's passes."
            )
        scheme = check_fusable(
            NAME, i, jobs, [s for job in jobs if not job.name.endswith("down_proj") for s in job.source_names()], rw
        )
        x = rw.node(linear_reading(rw, router)).inputs[0]
        members, output = _subgraph(rw, x, i, static)
        _check_members(rw, members, i, {router.weight_name} | {job.weight_name for job in jobs}, moe.num_experts)
        prefix = f"{hf.layer_prefix(i)}.mlp.experts"
        w13 = WeightJob(
            f"{prefix}.w13",
            tuple((gate.sources[0][0], up.sources[0][0]) for gate, up, _ in experts),
            stacked=True,
            scheme=scheme.name,
            role="linear",
        )
        w2 = WeightJob(
            f"{prefix}.w2",
            tuple((down.sources[0][0],) for _, _, down in experts),
            stacked=True,
            scheme=scheme.name,
            role="linear",
        )
        routing = next(rw.node(m) for m in members if rw.node(m).is_op("MoERouting"))
        attrs: dict[str, AttrValue] = {
            "num_experts": moe.num_experts,
            "top_k": routing.attrs["top_k"],
            "norm_topk_prob": routing.attrs["norm_topk_prob"],
            "linear": scheme.linear_op,
            "group_size": _group_size(scheme),
        }
        if scheme.row_align > 1:
            attrs.update(block_n=scheme.weights.block_n, block_k=scheme.weights.block_k)  # type: ignore[union-attr]
        inputs: tuple[str, ...] = (x, router.weight_name, w13.weight_name, w13.scale_name or "")
        inputs += (w2.weight_name, w2.scale_name or "")
        if scheme.zero_point:  # asymmetric int4: the stacks' zero points, last
            assert w13.zero_point_name is not None and w2.zero_point_name is not None
            inputs += (w13.zero_point_name, w2.zero_point_name)
        rw.remove(members)
        rw.insert(min(members), Node("MoE", DOMAIN, inputs, (output,), attrs, f"{hf.layer_prefix(i)}.mlp"))
        rw.replace_jobs([job.name for job in jobs], w13, w2)
    return rw.apply() if rw.changed else graph


def _group_size(scheme: QuantScheme) -> int:
    """The MoE op's group_size: the activation groups of an FP8 linear (DynamicQuant's), the weight
    groups along K of W4A16Linear (whose activations are not quantized), 0 for Gemm."""
    if scheme.int4 is not None:
        return scheme.int4.group_size
    return scheme.activation_group if scheme.quantizes_activations else 0  # type: ignore[return-value]


def _subgraph(rw: Rewrite, x: str, layer: int, static: set[str]) -> tuple[list[int], str]:
    """The nodes computed from `x` alone (plus `static`: weights, constants), and the one value they hand on.
    A collective (the AllReduce of a tensor-parallel rank's partial sum) is not part of the MLP."""
    available, members = {x}, []
    heap = list(rw.users(x))
    heapq.heapify(heap)
    seen = set(heap)
    while heap:
        index = heapq.heappop(heap)
        node = rw.node(index)
        if rw.is_removed(index) or node.op_type in COLLECTIVE_OPS:
            continue
        if not all(v in available or v in static for v in node.inputs):
            continue
        members.append(index)
        available.update(node.outputs)
        for out in node.outputs:
            for user in rw.users(out):
                if user not in seen:
                    seen.add(user)
                    heapq.heappush(heap, user)
    inside = set(members)
    escaping = sorted(
        {
            out
            for m in members
            for out in rw.node(m).outputs
            if out in rw.graph.outputs or any(u not in inside for u in rw.users(out))
        }
    )
    if len(escaping) != 1:
        raise PlanError(
            f"pass {NAME!r}: layer {layer}: the sparse MLP does not have the unfused MoE form of "
            f"docs/OPS.md (its nodes hand on {len(escaping)} values: {escaping[:4]})"
        )
    return sorted(members), escaping[0]


def _check_members(rw: Rewrite, members: list[int], layer: int, weights: set[str], experts: int) -> None:
    """PlanError unless `members` are exactly the router, one MoERouting, and every expert once."""
    nodes = [rw.node(m) for m in members]
    read = {w for node in nodes if (w := linear_weight(node)) is not None}
    routing = [node for node in nodes if node.is_op("MoERouting")]
    coefs = sorted(int(node.attrs["expert"]) for node in nodes if node.is_op("ExpertWeight"))
    if read != weights or len(routing) != 1 or coefs != list(range(experts)):
        raise PlanError(
            f"pass {NAME!r}: layer {layer}: the sparse MLP does not have the unfused MoE form of "
            "docs/OPS.md (router, MoERouting, and each expert's linears and ExpertWeight once)"
        )


PASS = GraphPass(NAME, fuse_moe_experts)
