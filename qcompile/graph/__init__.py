"""The graph stage: build the decoder graph of a model, run the recipe's fusion passes, export ONNX.

    graph = compile_graph(spec, recipe)        # build_graph + apply_passes(recipe.passes)
    write_onnx(graph, locations, art / "graph.onnx")

The operator contract the graph follows is docs/OPS.md (as data: qcompile.graph.ops).
"""

from __future__ import annotations

from qcompile.graph.build import build_graph, check_plan
from qcompile.graph.ir import Graph, Node, TensorType, check_graph
from qcompile.graph.onnx_export import TensorLocation, to_onnx, write_onnx
from qcompile.graph.passes import PASSES, apply_passes
from qcompile.recipe.schema import Recipe
from qcompile.source.spec import ModelSpec


def compile_graph(spec: ModelSpec, recipe: Recipe) -> Graph:
    """The graph of `spec` with `recipe.passes` applied in order (PlanError when the recipe does not fit)."""
    return apply_passes(build_graph(spec, recipe), recipe.passes)


__all__ = [
    "PASSES",
    "Graph",
    "Node",
    "TensorLocation",
    "TensorType",
    "apply_passes",
    "build_graph",
    "check_graph",
    "check_plan",
    "compile_graph",
    "to_onnx",
    "write_onnx",
]
