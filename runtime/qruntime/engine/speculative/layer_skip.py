"""The layer-skipping draft's plan: the artifact's own plan with some decoder layers left out.

A decoder layer adds its attention and MLP outputs to the residual stream; leaving layer i out hands
the stream as it entered layer i to whatever read it as it left. In the plan that is a rewiring:
layer i's nodes (named "layers.<i>." or "model.layers.<i>.", as the compiler names them) go, and
the first later node that reads their outputs (the next layer's input norm, or the final norm) reads,
at each such input, what layer i's first node read at the same position. Fused graphs carry the
stream as a pair (AddRMSNorm's x and residual, which it adds), unfused ones as one tensor; both
rewire the same way. The ops stay bound as they are: the draft shares the target's weights, kernels
and KV cache (it writes the KV of the layers it keeps; the verification writes every layer's again).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from qruntime.plan import GRAPH_INPUTS, BoundNode, Plan

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def layer_of(node_name: str) -> int | None:
    """The decoder layer a node belongs to by its name (None: embedding, final norm, lm_head)."""
    match = _LAYER.match(node_name)
    return int(match.group(1)) if match else None


def skip_layers(plan: Plan, skip: Sequence[int]) -> Plan:
    """`plan` without the decoder layers in `skip` (see the module docstring). ValueError naming the
    layer when it is not in the plan or its outputs are read in a way the rewiring cannot follow."""
    nodes = list(plan.nodes)
    for i in sorted(set(skip)):
        members = [n for n in nodes if layer_of(n.name) == i]
        if not members:
            raise ValueError(f"cannot skip layer {i}: the graph has no node of it")
        made = {name for n in members for name in n.outputs}
        entry, last = members[0], nodes.index(members[-1])
        after = nodes[last + 1 :]
        consumer = next((n for n in after if any(name in made for name in n.inputs)), None)
        if consumer is None:
            raise ValueError(f"cannot skip layer {i}: nothing after it reads its outputs")
        stream: dict[str, str] = {}
        for position, name in enumerate(consumer.inputs):
            if name not in made:
                continue
            before = entry.inputs[position] if position < len(entry.inputs) else None
            if before is None or before in plan.weights or before in GRAPH_INPUTS:
                raise ValueError(
                    f"cannot skip layer {i}: node {consumer.name!r} reads {name!r} at input {position}, where layer {i}'s "
                    f"first node {entry.name!r} reads no residual stream"
                )
            stream[name] = before
        unmapped = sorted({name for n in after for name in n.inputs if name in made and name not in stream})
        if unmapped or plan.output in made:
            raise ValueError(f"cannot skip layer {i}: {unmapped or [plan.output]} leave it other than as the stream")
        nodes = [
            dataclasses.replace(n, inputs=tuple(stream.get(name, name) for name in n.inputs))
            for n in nodes
            if layer_of(n.name) != i
        ]
    return Plan(_with_releases(nodes, plan), plan.weights, plan.output)


def _with_releases(nodes: list[BoundNode], plan: Plan) -> tuple[BoundNode, ...]:
    """The nodes with their `release` lists redone for the new order (an activation is dropped after
    its last reader)."""
    last_use: dict[str, int] = {}
    for index, node in enumerate(nodes):
        for name in node.inputs:
            if name and name not in plan.weights:
                last_use[name] = index
    return tuple(
        dataclasses.replace(
            node,
            release=tuple(
                n for n in dict.fromkeys(node.inputs) if n and last_use.get(n) == index and n not in GRAPH_INPUTS
            ),
        )
        for index, node in enumerate(nodes)
    )
