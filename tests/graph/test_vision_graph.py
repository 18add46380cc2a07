"""The Qwen3-VL vision graph (qcompile.graph.vision_tower): its inputs, output, weight jobs and node
order as docs/vision.md's contract gives them, and a checker-clean vision.onnx (its weights external
data in a real safetensors file). The values it computes are tested by
tests/runtime/vision/test_vision_encoder.py against the torch reference tower and transformers."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import onnx
import pytest
import torch
from graph_helpers import dense_spec
from qruntime.vision import VisionTowerConfig, tower_tensor_shapes
from safetensors.torch import save_file

from qcompile.compile.jobs import WeightJob
from qcompile.errors import PlanError
from qcompile.graph.ir import Graph
from qcompile.graph.onnx_export import TensorLocation, to_onnx, write_onnx
from qcompile.graph.vision_tower import VISION_EMBEDS, build_vision_graph, vision_tensor_shapes
from qcompile.io.safetensors_stream import read_header
from qcompile.source.spec import ModelSpec, VisionSpec

VISION = {
    "depth": 3,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_heads": 2,
    "patch_size": 2,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "in_channels": 3,
    "out_hidden_size": 48,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0, 2],
    "hidden_act": "gelu_pytorch_tanh",
}


def _spec(dtype: str = "bfloat16", **overrides: object) -> ModelSpec:
    config = {**VISION, **overrides}
    vision = VisionSpec(
        mrope_section=(2, 3, 3),
        image_token_id=90,
        video_token_id=None,
        vision_start_token_id=None,
        spatial_merge_size=config["spatial_merge_size"],
        deepstack_layers=len(config["deepstack_visual_indexes"]),
        tower_config=json.dumps(config, sort_keys=True),
    )
    return dense_spec(dtype=dtype, architecture="Qwen3VLForConditionalGeneration", vision=vision)


def _write(graph: Graph, root: Path) -> dict[str, TensorLocation]:
    """Random weights for the graph in root/weights/vision.safetensors; their locations."""
    rel = "weights/vision.safetensors"
    (root / "weights").mkdir()
    tensors = {n: torch.randn(t.shape).to(t.dtype) for n, t in graph.weight_tensors.items()}
    save_file(tensors, str(root / rel))
    entries, _ = read_header(root / rel)
    return {n: TensorLocation(rel, e.begin, e.nbytes, e.torch_dtype, e.shape) for n, e in entries.items()}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_inputs_output_and_weights_follow_the_contract(dtype):
    spec = _spec(dtype)
    graph = build_vision_graph(spec)
    model = getattr(torch, dtype)
    config = VisionTowerConfig.from_dict(VISION)
    p, d = "P", config.head_dim
    expected_inputs = {
        "pixel_values": (model, (p, config.patch_dim)),
        "pos_index": (torch.int64, (4, p)),
        "pos_weight": (torch.float32, (4, p)),
        "rotary_cos": (torch.float32, (p, d)),
        "rotary_sin": (torch.float32, (p, d)),
        "cu_seqlens": (torch.int32, ("S+1",)),
    }
    assert graph.inputs == tuple(expected_inputs)
    for name, (dt, shape) in expected_inputs.items():
        assert (graph.types[name].dtype, graph.types[name].shape) == (dt, shape), name
    assert graph.outputs == (VISION_EMBEDS,)
    assert graph.types[VISION_EMBEDS].dtype == model
    assert graph.types[VISION_EMBEDS].shape == ("P/4", 3 * config.out_hidden_size)

    # one unquantized job per tower tensor, written under its checkpoint name and shape
    shapes = {"model.visual." + n: s for n, s in tower_tensor_shapes(config).items()}
    assert vision_tensor_shapes(spec) == shapes
    assert set(graph.weights) == set(shapes)
    for name, job in graph.weights.items():
        assert isinstance(job, WeightJob)
        assert (job.weight_name, job.sources, job.scheme, job.stacked) == (name, ((name,),), "none", False)
    assert {job.role for job in graph.weights.values()} == {"vision"}
    assert {n: (t.dtype, t.shape) for n, t in graph.weight_tensors.items()} == {
        n: (model, s) for n, s in shapes.items()
    }


def test_node_order_follows_the_tower():
    graph = build_vision_graph(_spec())
    ops = Counter(node.op_type for node in graph.nodes)
    depth, mergers = VISION["depth"], 1 + len(VISION["deepstack_visual_indexes"])
    assert ops["VisionAttention"] == depth
    assert ops["LayerNormalization"] == 2 * depth + mergers
    assert ops["Gemm"] == 1 + 4 * depth + 2 * mergers  # patch embed, qkv / proj / fc1 / fc2, mergers' fc1 / fc2
    assert ops["Gelu"] == depth + mergers and ops["PositionGrid"] == 1 and ops["Concat"] == 1
    by_output = {out: node for node in graph.nodes for out in node.outputs}
    # the patch embedding reads the Conv3d weight reshaped to [hidden, patch_dim]
    patch = by_output["patch_embed"]
    assert patch.op_type == "Gemm" and by_output[patch.inputs[1]].op_type == "Reshape"
    assert by_output[patch.inputs[1]].inputs[0] == "model.visual.patch_embed.proj.weight"
    # the merger normalizes each patch before the m² concatenation, the deepstack mergers after it
    assert by_output["merger.shuffle"].inputs[0] == "merger.norm"
    assert by_output["deepstack_merger_list.0.norm"].inputs[0] == "deepstack_merger_list.0.shuffle"
    # deepstack merger j reads block deepstack_visual_indexes[j]'s output
    assert by_output["deepstack_merger_list.0.shuffle"].inputs[0] == "blocks.0.hidden"
    assert by_output["deepstack_merger_list.1.shuffle"].inputs[0] == "blocks.2.hidden"
    assert by_output["merger.norm"].inputs[0] == f"blocks.{depth - 1}.hidden"
    concat = by_output[VISION_EMBEDS]
    assert concat.inputs == (
        "merger.linear_fc2",
        "deepstack_merger_list.0.linear_fc2",
        "deepstack_merger_list.1.linear_fc2",
    )
    assert dict(concat.attrs) == {"axis": -1}
    attention = by_output["blocks.1.attn"]
    assert attention.inputs == ("blocks.1.attn.qkv", "rotary_cos", "rotary_sin", "cu_seqlens")
    head_dim = VISION["hidden_size"] // VISION["num_heads"]
    assert dict(attention.attrs) == {"num_heads": 2, "head_dim": head_dim, "scale": head_dim**-0.5}
    assert by_output["blocks.0.mlp.act"].attrs["approximate"] == "tanh"
    assert by_output["merger.act"].attrs.get("approximate", "none") == "none"


@pytest.mark.parametrize("hidden_act, ops", [("gelu", {"Gelu": 4}), ("silu", {"Gelu": 1, "Sigmoid": 3, "Mul": 3})])
def test_activation_and_no_deepstack(hidden_act, ops):
    graph = build_vision_graph(_spec(hidden_act=hidden_act, deepstack_visual_indexes=[], spatial_merge_size=1))
    counts = Counter(node.op_type for node in graph.nodes)
    assert {op: counts[op] for op in ops} == ops
    assert "Concat" not in counts  # vision_embeds is the merger's output itself
    assert graph.nodes[-1].outputs == (VISION_EMBEDS,) and graph.nodes[-1].op_type == "Gemm"
    assert graph.types[VISION_EMBEDS].shape == ("P", VISION["out_hidden_size"])
    if hidden_act == "gelu":
        assert {node.attrs["approximate"] for node in graph.nodes if node.name.endswith("mlp.act")} == {"none"}
    else:
        silu = next(node for node in graph.nodes if node.name == "blocks.0.mlp.act")
        assert silu.inputs == ("blocks.0.mlp.linear_fc1", "blocks.0.mlp.act.sigmoid")


@pytest.mark.parametrize("overrides", [{}, {"hidden_act": "silu", "deepstack_visual_indexes": []}])
def test_vision_onnx_passes_the_checker(tmp_path, monkeypatch, op_schemas, overrides):
    graph = build_vision_graph(_spec(**overrides))
    locations = _write(graph, tmp_path)
    model = to_onnx(graph, locations)
    monkeypatch.chdir(tmp_path)  # an in-memory model's external data resolves from the working directory
    onnx.checker.check_model(model, full_check=True, check_custom_domain=True)
    write_onnx(graph, locations, tmp_path / "vision.onnx")
    onnx.checker.check_model(str(tmp_path / "vision.onnx"), full_check=True, check_custom_domain=True)
    initializers = {init.name for init in model.graph.initializer}
    assert initializers == set(graph.weight_tensors) | set(graph.constants)


def test_the_checker_sees_a_broken_vision_attention(tmp_path, monkeypatch, op_schemas):
    graph = build_vision_graph(_spec())
    model = to_onnx(graph, _write(graph, tmp_path))
    broken = next(node for node in model.graph.node if node.op_type == "VisionAttention")
    kept = [attr for attr in broken.attribute if attr.name != "scale"]
    del broken.attribute[:]
    broken.attribute.extend(kept)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(onnx.checker.ValidationError, match="scale"):
        onnx.checker.check_model(model, check_custom_domain=True)


def test_a_spec_without_a_tower_is_refused():
    with pytest.raises(PlanError, match="has no vision tower"):
        build_vision_graph(dense_spec())
    broken = dataclasses.replace(_spec(), vision=dataclasses.replace(_spec().vision, tower_config='{"depth": 1}'))
    with pytest.raises(PlanError, match="vision tower config: .*is missing"):
        build_vision_graph(broken)
