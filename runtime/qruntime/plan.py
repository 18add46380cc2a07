"""The execution plan: graph.onnx's nodes, each bound once to an op implementation, in order.

The plan knows ops, not models: whatever graph the compiler wrote (fused or unfused, dense or MoE)
runs if each of its op types has an implementation in the registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import onnx
import torch

from qruntime.ops.base import Op, OpBindError, OpEnv, StepContext

GRAPH_INPUTS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "block_tables",
    "context_lens",
    "query_start_loc",
    "logits_indices",
)


class PlanError(ValueError):
    """graph.onnx cannot be planned: unknown op, missing weight, bad wiring or attributes (node named)."""


@dataclass(frozen=True)
class BoundNode:
    name: str
    op: Op
    inputs: tuple[str, ...]  # "" = optional input left out
    outputs: tuple[str, ...]
    release: tuple[str, ...]  # activations no later node reads: dropped after this node


def _attributes(node: onnx.NodeProto) -> dict:
    attrs = {}
    for attr in node.attribute:
        value = onnx.helper.get_attribute_value(attr)
        attrs[attr.name] = value.decode() if isinstance(value, bytes) else value
    return attrs


class Plan:
    """Bound nodes plus the weights they read; `run(step, feeds)` executes one forward step."""

    def __init__(self, nodes: tuple[BoundNode, ...], weights: Mapping[str, torch.Tensor], output: str) -> None:
        self.nodes = nodes
        self.weights = weights
        self.output = output
        self.capturable = all(node.op.capturable for node in nodes)  # may run inside a CUDA graph

    @classmethod
    def build(
        cls,
        graph: onnx.GraphProto,
        weights: Mapping[str, torch.Tensor],
        env: OpEnv,
        registry: Mapping[tuple[str, str], type[Op]],
    ) -> Plan:
        inputs = tuple(i.name for i in graph.input)
        if inputs != GRAPH_INPUTS:
            raise PlanError(f"graph inputs {list(inputs)} are not the format-1 step inputs {list(GRAPH_INPUTS)}")
        if len(graph.output) != 1:
            raise PlanError(f"graph has {len(graph.output)} outputs; format 1 has one (logits)")
        known = set(weights) | set(inputs)
        last_use: dict[str, int] = {}
        for index, node in enumerate(graph.node):
            for name in node.input:
                if name and name not in weights:
                    last_use[name] = index
        bound = []
        for index, node in enumerate(graph.node):
            where = f"graph.onnx node {node.name!r} ({node.domain or 'ai.onnx'}::{node.op_type})"
            impl = registry.get((node.domain, node.op_type))
            if impl is None:
                ops = sorted(f"{d or 'ai.onnx'}::{t}" for d, t in registry)
                raise PlanError(f"{where}: no implementation of this op; the runtime knows {ops}")
            missing = [name for name in node.input if name and name not in known]
            if missing:
                raise PlanError(f"{where}: inputs {missing} are neither weights nor outputs of earlier nodes")
            consts = tuple(weights.get(name) if name else None for name in node.input)
            try:
                op = impl(_attributes(node), env, consts)
            except OpBindError as exc:
                raise PlanError(f"{where}: {exc}") from exc
            known.update(node.output)
            release = tuple(n for n in dict.fromkeys(node.input) if n and last_use.get(n) == index and n not in inputs)
            bound.append(BoundNode(node.name, op, tuple(node.input), tuple(node.output), release))
        output = graph.output[0].name
        if output not in known:
            raise PlanError(f"graph output {output!r} is produced by no node")
        return cls(tuple(bound), weights, output)

    def run(self, step: StepContext, feeds: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One forward step: feeds are the GRAPH_INPUTS tensors; returns logits [B, V]."""
        env: dict[str, torch.Tensor | None] = {**self.weights, **feeds, "": None}
        for node in self.nodes:
            result = node.op(step, *(env[name] for name in node.inputs))
            env.update(zip(node.outputs, result if isinstance(result, tuple) else (result,), strict=True))
            for name in node.release:
                del env[name]
        return env[self.output]
