"""What the Qwen3-VL text graph computes, run with the runtime's reference ops (graph_reference.py), against
Qwen3-VL's text decoder in plain torch (qruntime.vision.reference_text.decode_layers, M-RoPE cos / sin from
qruntime.vision.positions.mrope_cos_sin) on the same weights: the image rows written over the token
embeddings, each DeepStack feature added after its layer, M-RoPE positions [3, T]; fused and unfused, over
chunked prefill steps (image rows in a later chunk, sequences without any) and a decode step (Nv = 0); the
fused graph also through its ONNX export and the runtime's Plan."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from graph_helpers import PASS_NAMES, kv, random_sources, recipe
from graph_reference import Reference
from qruntime.ops.base import OpEnv
from qruntime.ops.registry import reference_ops
from qruntime.plan import Plan
from vision_reference import BLOCK, CHUNKS, MAX_BLOCKS, assert_steps, reference_weights, sequences
from vision_specs import vl_dense, vl_moe

from qcompile.graph import Graph, TensorLocation, compile_graph, to_onnx


def _through_onnx(ref: Reference, graph: Graph) -> None:
    """Make `ref` run the Plan qruntime binds to the exported graph.onnx instead of the IR's nodes: the
    attributes (mrope_section as INTS, ScatterND's reduction as a string) and Split sizes as an artifact
    carries them (the weights are ref's own; the locations only satisfy the exporter)."""
    locations = {
        name: TensorLocation("weights/w.safetensors", 0, math.prod(t.shape) * t.dtype.itemsize, t.dtype, t.shape)
        for name, t in graph.weight_tensors.items()
    }
    model = to_onnx(graph, locations)
    env = OpEnv(graph.model_dtype, torch.device("cpu"), ref.cache.spec)
    plan = Plan.build(model.graph, ref.tensors, env, reference_ops())
    ref.nodes = [(node.op, node) for node in plan.nodes]  # type: ignore[misc]


@pytest.mark.parametrize(
    ("passes", "runner"), [("none", "ir"), ("all", "ir"), ("all", "onnx-plan")], ids=["none", "all", "all-onnx"]
)
@pytest.mark.parametrize("make_spec", [vl_dense, vl_moe], ids=["dense", "moe"])
def test_vision_graph_computes_qwen3_vl(rng: random.Random, make_spec, passes: str, runner: str) -> None:
    torch.manual_seed(rng.randrange(1 << 30))
    spec = make_spec(dtype="float32")
    sources = random_sources(spec)
    rec = dataclasses.replace(recipe("bf16"), passes=PASS_NAMES if passes == "all" else (), kv_cache=kv(BLOCK))
    graph = compile_graph(spec, rec)
    ref = Reference(graph, sources, num_slots=len(CHUNKS) * MAX_BLOCKS * BLOCK)
    if runner == "onnx-plan":
        _through_onnx(ref, graph)
    assert_steps(ref.run, spec, sequences(spec, rng), reference_weights(spec, sources))
