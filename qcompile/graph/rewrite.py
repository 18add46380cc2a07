"""Rewrite: the edits one pass makes to a graph, collected against its node indices and applied at once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from qcompile.compile.jobs import WeightJob
from qcompile.graph.ir import Graph, Node, TensorType, constant_name


class Rewrite:
    """Collects removals, insertions, renamed uses and weight changes; `apply()` returns the new Graph.

    Indices are those of the original graph. A node inserted `at` index i goes where node i was (before
    it, if it stays). Matches of one pass must not overlap: each original node is removed at most once.
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.producer = graph.producers()
        self.consumer = graph.consumers()
        self._removed: set[int] = set()
        self._inserted: dict[int, list[Node]] = {}
        self._types: dict[str, TensorType] = {}
        self._renames: list[tuple[str, str, int]] = []
        self._dropped: set[str] = set()
        self._added: dict[str, list[WeightJob]] = {}
        self._constants: dict[str, np.ndarray] = dict(graph.constants)

    # --- queries on the original graph -------------------------------------------------------------
    def node(self, index: int) -> Node:
        return self.graph.nodes[index]

    def producer_of(self, value: str, op_type: str | None = None) -> int | None:
        """Index of the node producing `value` (and being `op_type`, when given), else None."""
        index = self.producer.get(value)
        if index is None or index in self._removed:
            return None
        if op_type is not None and not self.node(index).is_op(op_type):
            return None
        return index

    def users(self, value: str) -> list[int]:
        return self.consumer.get(value, [])

    def sole_user(self, value: str, op_type: str) -> int | None:
        """Index of the only node reading `value` when it is `op_type` and `value` is not a graph output."""
        users = self.users(value)
        if len(users) != 1 or value in self.graph.outputs or users[0] in self._removed:
            return None
        return users[0] if self.node(users[0]).is_op(op_type) else None

    def type_of(self, value: str) -> TensorType:
        return self._types.get(value) or self.graph.types[value]

    def constant(self, name: str) -> np.ndarray | None:
        return self._constants.get(name)

    def is_removed(self, index: int) -> bool:
        return index in self._removed

    # --- edits -------------------------------------------------------------------------------------
    def remove(self, indices: Iterable[int]) -> None:
        for index in indices:
            if index in self._removed:
                raise ValueError(f"node {self.node(index).name!r} is removed twice by one pass")
            self._removed.add(index)

    def insert(self, at: int, node: Node, types: Mapping[str, TensorType] | None = None) -> None:
        """Place `node` where original node `at` is; `types` gives the types of its new output values."""
        self._inserted.setdefault(at, []).append(node)
        self._types.update(types or {})

    def rename_uses(self, old: str, new: str, after: int) -> None:
        """Make every node placed after original position `after` read `new` instead of `old`."""
        self._renames.append((old, new, after))

    def add_constant(self, values: Sequence[int]) -> str:
        """An int64 1-D constant, named by its content (shared by every node that needs the same one)."""
        name = constant_name(list(values))
        self._constants[name] = np.asarray(values, dtype=np.int64)
        return name

    def replace_jobs(self, old: Sequence[str], *new: WeightJob) -> None:
        """Drop jobs `old` and put `new` where the first of them was, keeping the writing order."""
        self._dropped.update(old)
        self._added.setdefault(old[0], []).extend(new)

    # --- result ------------------------------------------------------------------------------------
    @property
    def changed(self) -> bool:
        return bool(self._removed or self._inserted or self._renames or self._dropped)

    def apply(self) -> Graph:
        """The rewritten graph, with types and constants pruned to the values still in use."""
        placed: list[tuple[int, Node]] = []
        for index, node in enumerate(self.graph.nodes):
            placed.extend((index, new) for new in self._inserted.get(index, []))
            if index not in self._removed:
                placed.append((index, node))
        end = len(self.graph.nodes)
        placed.extend((end, new) for new in self._inserted.get(end, []))
        nodes = [self._renamed(position, node) for position, node in placed]
        types = {**self.graph.types, **self._types}
        live = set(self.graph.inputs) | {out for node in nodes for out in node.outputs}
        read = {name for node in nodes for name in node.inputs}
        weights: dict[str, WeightJob] = {}
        for name, job in self.graph.weights.items():
            weights.update((new.name, new) for new in self._added.get(name, []))
            if name not in self._dropped:
                weights[name] = job
        return self.graph.replace(
            nodes=tuple(nodes),
            types={name: t for name, t in types.items() if name in live},
            weights=weights,
            constants={name: c for name, c in self._constants.items() if name in read},
        )

    def _renamed(self, position: int, node: Node) -> Node:
        inputs = list(node.inputs)
        for old, new, after in self._renames:
            if position > after:
                inputs = [new if name == old else name for name in inputs]
        if inputs == list(node.inputs):
            return node
        return Node(node.op_type, node.domain, tuple(inputs), node.outputs, node.attrs, node.name)
