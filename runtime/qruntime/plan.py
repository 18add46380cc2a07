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
VISION_INPUTS = ("vision_rows", "vision_embeds")  # a Qwen3-VL graph's image rows (docs/vision.md)
# the inputs with a row per sequence of the step (the rest have a row per token)
SEQUENCE_INPUTS = ("block_tables", "context_lens", "query_start_loc", "logits_indices")


class PlanError(ValueError):
    """graph.onnx cannot be planned: unknown op, missing weight, bad wiring or attributes (node named)."""


@dataclass(frozen=True)
class BoundNode:
    name: str
    op: Op
    inputs: tuple[str, ...]  # "" = optional input left out
    outputs: tuple[str, ...]
    release: tuple[str, ...]  # activations no later node reads: dropped after this node


@dataclass(frozen=True)
class Piece:
    """Nodes [start, stop) of a plan, for a piecewise CUDA graph (engine/piecewise_graphs.py): a
    piece whose nodes depend on the step's token count alone is captured once per token bucket; an
    eager one runs op by op at every step, on the step's sequences (a graph-splitting op such as
    attention, or the nodes from the logits gather on, whose rows are sequences, not tokens)."""

    start: int
    stop: int
    eager: bool
    reads: tuple[str, ...]  # what its nodes read from outside it: weights, graph inputs, earlier outputs
    writes: tuple[str, ...]  # what it makes that later nodes read (or the plan's output)


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
        if inputs not in (GRAPH_INPUTS, GRAPH_INPUTS + VISION_INPUTS):
            raise PlanError(
                f"graph inputs {list(inputs)} are not the format-1 step inputs {list(GRAPH_INPUTS)} "
                f"(a Qwen3-VL graph's followed by {list(VISION_INPUTS)})"
            )
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
        self.run_nodes(step, env, 0, len(self.nodes))
        return env[self.output]

    def run_nodes(self, step: StepContext, env: dict[str, torch.Tensor | None], start: int, stop: int) -> None:
        """Run nodes [start, stop) over `env` (name -> tensor, "" -> None) in place: each node's
        outputs are added, and the activations no later node reads are dropped after their last reader."""
        for node in self.nodes[start:stop]:
            result = node.op(step, *(env[name] for name in node.inputs))
            env.update(zip(node.outputs, result if isinstance(result, tuple) else (result,), strict=True))
            for name in node.release:
                del env[name]

    def pieces(self) -> tuple[Piece, ...]:
        """The nodes in maximal runs of captured and of eager ones (see Piece). A node is eager when
        its op splits the graph, or when it reads a per-sequence value: a SEQUENCE_INPUTS tensor, or
        the output of another node that reads one and does not split the graph (the graph-splitting
        ops map the sequences' metadata back to rows of tokens)."""
        per_sequence = set(SEQUENCE_INPUTS)
        eager = []
        for node in self.nodes:
            reads_sequences = any(name in per_sequence for name in node.inputs)
            if reads_sequences and not node.op.splits_graph:
                per_sequence.update(node.outputs)
            eager.append(node.op.splits_graph or reads_sequences)
        runs, start = [], 0
        for index in range(1, len(self.nodes) + 1):
            if index == len(self.nodes) or eager[index] != eager[start]:
                runs.append((start, index, eager[start]))
                start = index
        return tuple(self._piece(start, stop, is_eager) for start, stop, is_eager in runs)

    def _piece(self, start: int, stop: int, eager: bool) -> Piece:
        made: set[str] = set()
        reads: dict[str, None] = {}
        for node in self.nodes[start:stop]:
            reads.update((name, None) for name in node.inputs if name and name not in made)
            made.update(node.outputs)
        later = {name for node in self.nodes[stop:] for name in node.inputs} | {self.output}
        writes = tuple(name for node in self.nodes[start:stop] for name in node.outputs if name in later)
        return Piece(start, stop, eager, tuple(reads), writes)
