"""The compiler's graph IR: immutable nodes in topological order, typed values, declared weights.

A Graph is the decoder of one ModelSpec as a list of Nodes whose inputs and outputs are value
names (SSA: every value produced once). Weights are declared as WeightJobs; a node reads a job's
tensors by `job.weight_name` / `job.scale_name`. Small int64 initializers (Reshape shapes, Split
sizes) live in `constants`. Passes are pure functions Graph -> Graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

import numpy as np
import torch

from qcompile.compile.jobs import WeightJob
from qcompile.compile.sharding import Sharding
from qcompile.graph.ops import OP_DOMAINS, SIGNATURES, check_signature
from qcompile.source.model import expected_tensors
from qcompile.source.spec import ModelSpec

AttrValue = int | float | str | tuple[int, ...]
Dim = int | str  # a concrete size or a symbolic one ("T", "B", ...)


@dataclass(frozen=True)
class TensorType:
    """Element type and shape of a value."""

    dtype: torch.dtype
    shape: tuple[Dim, ...]

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class Node:
    """One operator application. An empty input name is an absent optional input."""

    op_type: str
    domain: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, AttrValue]
    name: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "attrs", MappingProxyType(dict(self.attrs)))

    def is_op(self, op_type: str) -> bool:
        """Whether this node is `op_type` in the domain the contract gives it."""
        return self.op_type == op_type and self.domain == OP_DOMAINS.get(op_type)


@dataclass(frozen=True, eq=False)
class Graph:
    """One forward step of the decoder (see docs/OPS.md). Build with `build_graph`, rewrite with passes."""

    spec: ModelSpec
    nodes: tuple[Node, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    types: Mapping[str, TensorType]  # every graph input and node output
    weights: Mapping[str, WeightJob]  # by job name, in writing order
    constants: Mapping[str, np.ndarray]  # small int64 initializers
    applied_passes: tuple[str, ...] = ()
    metadata: Mapping[str, str] = field(default_factory=dict)
    tp: int = 1  # tensor-parallel degree: the graph is each rank's, its weights each rank's slices

    def __post_init__(self) -> None:
        for name in ("types", "weights", "constants", "metadata"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        object.__setattr__(self, "nodes", tuple(self.nodes))

    def replace(self, **changes: object) -> Graph:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @property
    def model_dtype(self) -> torch.dtype:
        return getattr(torch, self.spec.dtype)

    @cached_property
    def weight_tensors(self) -> Mapping[str, TensorType]:
        """Tensor name -> type of every tensor the weight jobs write (the graph's external initializers):
        at tp > 1, of one rank's slice of it."""
        shapes = expected_tensors(self.spec)
        sharding = Sharding(self.spec, self.tp) if self.tp > 1 else None
        out: dict[str, TensorType] = {}
        for job in self.weights.values():
            splits = sharding.splits(job, shapes) if sharding is not None else {}
            for tensor in job.outputs(shapes, self.model_dtype):
                split = splits.get(tensor.name)
                out[tensor.name] = TensorType(tensor.dtype, split.shape(tensor.shape) if split else tensor.shape)
        return MappingProxyType(out)

    def producers(self) -> dict[str, int]:
        """Value name -> index of the node that produces it."""
        return {out: i for i, node in enumerate(self.nodes) for out in node.outputs}

    def consumers(self) -> dict[str, list[int]]:
        """Value name -> indices of the nodes that read it, in order (a node once, however often it reads it)."""
        users: dict[str, list[int]] = {}
        for i, node in enumerate(self.nodes):
            for name in node.inputs:
                if not name:
                    continue
                readers = users.get(name)
                if readers is None:
                    users[name] = [i]
                elif readers[-1] != i:
                    readers.append(i)
        return users

    def weight_names(self) -> set[str]:
        """Names of the tensors the weight jobs write (cheaper than `weight_tensors` when types are not needed)."""
        names = {job.weight_name for job in self.weights.values()}
        names.update(name for job in self.weights.values() for name in job.quant_names)
        return names

    def op_types(self) -> set[tuple[str, str]]:
        """(domain, op type) of every node."""
        return {(node.domain, node.op_type) for node in self.nodes}


def constant_name(values: tuple[int, ...] | list[int]) -> str:
    """The name of the int64 1-D constant holding `values` (equal constants are shared)."""
    return "const." + "_".join(str(v) for v in values).replace("-", "m")


def check_graph(graph: Graph) -> None:
    """Raise ValueError naming the first inconsistency: a value used before it is produced or produced
    twice, an untyped value, an op outside the contract, an unused or undeclared weight or constant."""
    static = graph.weight_names() | set(graph.constants)
    defined = set(graph.inputs)
    clash = defined & static
    if clash:
        raise ValueError(f"graph inputs shadow weights or constants: {sorted(clash)}")
    used: set[str] = set()
    names: set[str] = set()
    for node in graph.nodes:
        if OP_DOMAINS.get(node.op_type) != node.domain:
            raise ValueError(f"node {node.name!r}: op {node.domain}:{node.op_type} is not in the operator contract")
        problem = (
            check_signature(node.op_type, node.inputs, node.outputs, node.attrs) if node.op_type in SIGNATURES else None
        )
        if problem:
            raise ValueError(f"node {node.name!r}: {node.op_type} {problem}")
        if node.name in names:
            raise ValueError(f"node name {node.name!r} is used twice")
        names.add(node.name)
        for name in node.inputs:
            if name and name not in defined and name not in static:
                raise ValueError(f"node {node.name!r} reads {name!r} before it is produced")
            used.add(name)
        for name in node.outputs:
            if name in defined or name in static:
                raise ValueError(f"node {node.name!r}: value {name!r} is produced twice")
            if name not in graph.types:
                raise ValueError(f"node {node.name!r}: value {name!r} has no type")
            defined.add(name)
    missing = [name for name in (*graph.inputs, *graph.outputs) if name not in graph.types]
    if missing:
        raise ValueError(f"graph inputs/outputs without a type: {missing}")
    unproduced = [name for name in graph.outputs if name not in defined]
    if unproduced:
        raise ValueError(f"graph outputs never produced: {unproduced}")
    unused = sorted(static - used)
    if unused:
        raise ValueError(f"weights or constants no node reads: {unused[:5]}")
