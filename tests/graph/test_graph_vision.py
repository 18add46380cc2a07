"""The Qwen3-VL text graph (docs/vision.md, "Artifacts"): its inputs, the Split of vision_embeds, the
ScatterND of the image rows and of the DeepStack features (after layers 0 .. D-1 only, after the residual
sum and at tp > 1 after the all-reduce), mrope_section on every rope op, fused and unfused, and the ONNX
checker; a Qwen3 graph has none of it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx
import pytest
import torch
from graph_helpers import PASS_NAMES, recipe, write_weights
from onnx import TensorProto, helper
from vision_specs import MROPE_SECTION, text_only, vl_dense, vl_moe

from qcompile.errors import PlanError
from qcompile.graph import Graph, Node, build_graph, compile_graph, to_onnx
from qcompile.source.spec import ModelSpec

SPECS = {"dense": vl_dense, "moe": vl_moe}
CASES = [
    (spec, tp, passes, depth)
    for spec in SPECS
    for tp in (1, 2)
    for passes in ("all", "none")
    for depth in (0, 2, 3)  # no DeepStack, the first two of three layers, every layer
]
NORM_OPS = ("RMSNormalization", "AddRMSNorm", "AddRMSNormQuant", "AllReduceAddRMSNorm", "AllReduceAddRMSNormQuant")
ROPE_OPS = ("RoPE", "QKNormRoPEKVWrite")


def _graph(spec: ModelSpec, tp: int, passes: str, rec: str = "ptpc-fp8") -> Graph:
    return compile_graph(spec, dataclasses.replace(recipe(rec, passes=PASS_NAMES if passes == "all" else ()), tp=tp))


def _producer(graph: Graph, value: str) -> Node:
    return graph.nodes[graph.producers()[value]]


def _readers(graph: Graph, value: str) -> list[Node]:
    return [graph.nodes[i] for i in graph.consumers().get(value, [])]


def _layer_input_norm(graph: Graph, layer: int) -> Node:
    """The node normalizing decoder layer `layer`'s input (or the final norm, for layer = L)."""
    want = "model.norm.weight" if layer == graph.spec.num_hidden_layers else f"model.layers.{layer}.input_layernorm"
    (norm,) = [n for n in graph.nodes if n.op_type in NORM_OPS and n.inputs[-1].startswith(want)]
    return norm


@pytest.mark.parametrize(("spec_name", "tp", "passes", "depth"), CASES)
def test_image_rows_and_deepstack_features_are_scattered_where_the_contract_says(
    spec_name: str, tp: int, passes: str, depth: int
) -> None:
    spec = SPECS[spec_name](depth)
    graph = _graph(spec, tp, passes)
    hidden = spec.hidden_size
    types = {name: (graph.types[name].dtype, graph.types[name].shape) for name in graph.inputs}
    assert graph.inputs[-2:] == ("vision_rows", "vision_embeds")
    assert types["positions"] == (torch.int64, (3, "T"))
    assert types["vision_rows"] == (torch.int64, ("Nv", 1))
    assert types["vision_embeds"] == (torch.bfloat16, ("Nv", (1 + depth) * hidden))

    splits = [n for n in graph.nodes if "vision_embeds" in n.inputs]
    if depth == 0:  # nothing to split: the image part is vision_embeds itself
        assert [n.op_type for n in splits] == ["ScatterND"]
        parts: tuple[str, ...] = ("vision_embeds",)
    else:
        (split,) = splits
        assert split.op_type == "Split" and split.attrs == {"axis": -1}
        assert graph.constants[split.inputs[1]].tolist() == [hidden] * (1 + depth)
        assert all(graph.types[out].shape == ("Nv", hidden) for out in split.outputs)
        parts = split.outputs
    scatters = [n for n in graph.nodes if n.op_type == "ScatterND"]
    assert len(scatters) == 1 + depth
    assert all(n.inputs[1] == "vision_rows" and n.domain == "" for n in scatters)

    image = scatters[0]  # over the token embeddings, before layer 0
    assert _producer(graph, image.inputs[0]).op_type == "Gather"
    assert image.inputs[2] == parts[0] and image.attrs == {"reduction": "none"}
    assert _layer_input_norm(graph, 0).inputs[0] == image.outputs[0]

    for i, scatter in enumerate(scatters[1:]):  # after layer i: the residual sum, then the feature
        assert scatter.inputs[2] == parts[1 + i] and scatter.attrs == {"reduction": "add"}
        add = _producer(graph, scatter.inputs[0])
        assert add.op_type == "Add" and add.outputs == (f"layers.{i}.hidden",)
        assert add.inputs[0] == f"layers.{i}.mlp_out"
        mlp_out = _producer(graph, add.inputs[0])
        assert mlp_out.op_type == "AllReduce" if tp > 1 else mlp_out.op_type != "AllReduce"
        assert [n.op_type for n in _readers(graph, add.outputs[0])] == ["ScatterND"]
        norm = _layer_input_norm(graph, i + 1)  # the next layer reads the scattered state, whole
        assert norm.inputs[0] == scatter.outputs[0]
        if norm.op_type != "RMSNormalization":  # fused: no residual to add, residual_out is x itself
            assert norm.op_type in ("AddRMSNorm", "AddRMSNormQuant") and norm.inputs[1] == ""
    if depth < spec.num_hidden_layers:  # layer D's output goes on as Qwen3's does
        after = _producer(graph, _layer_input_norm(graph, depth + 1).inputs[0])
        assert after.op_type != "ScatterND"
        assert not any(n.op_type == "ScatterND" for n in _readers(graph, f"layers.{depth}.hidden"))

    ropes = [n for n in graph.nodes if n.op_type in ROPE_OPS]
    assert len(ropes) == spec.num_hidden_layers * (1 if passes == "all" else 2)
    assert all(
        n.attrs["mrope_section"] == MROPE_SECTION and n.inputs[-2 if passes == "all" else 1] == "positions"
        for n in ropes
    )
    if passes == "all":
        assert {n.op_type for n in ropes} == {"QKNormRoPEKVWrite"}


Row = tuple[str, tuple[str, ...], tuple[str, ...], dict]


def _strip_vision(graph: Graph) -> list[Row]:
    """The graph's nodes without the vision nodes (a ScatterND's readers read its data input instead, and
    a fused norm's residual_out named after a ScatterND output, `out.residual`, is `data.residual`) and
    without mrope_section: (op, inputs, outputs, attributes)."""
    alias: dict[str, str] = {}
    for node in graph.nodes:
        if node.op_type == "ScatterND":
            alias[node.outputs[0]] = alias.get(node.inputs[0], node.inputs[0])
            alias[f"{node.outputs[0]}.residual"] = f"{alias[node.outputs[0]]}.residual"
    return [
        (
            node.op_type,
            tuple(alias.get(i, i) for i in node.inputs),
            tuple(alias.get(o, o) for o in node.outputs),
            {k: v for k, v in node.attrs.items() if k != "mrope_section"},
        )
        for node in graph.nodes
        if node.op_type != "ScatterND" and "vision_embeds" not in node.inputs
    ]


def _unfold_layer_ends(rows: list[Row], depth: int) -> list[Row]:
    """Qwen3's fused graph as the VL one must be: the norm that folds layer i < D's residual sum
    ([AllReduce]AddRMSNorm[Quant](mlp_out, attn_residual, w) -> (..., layers.i.hidden)) as
    [AllReduce], Add, then the norm with no residual (a ScatterND sits between the sum and the norm), whose
    residual_out (layers.i.hidden.residual) the later nodes read."""
    out: list[Row] = []
    renames: dict[str, str] = {}
    for op, inputs, outputs, attrs in rows:
        inputs = tuple(renames.get(i, i) for i in inputs)
        layer = next((i for i in range(depth) if outputs[-1] == f"layers.{i}.hidden"), None)
        if layer is None:
            out.append((op, inputs, outputs, attrs))
            continue
        p, (x, residual, w) = f"layers.{layer}.", inputs
        if op.startswith("AllReduce"):
            out.append(("AllReduce", (x,), (p + "mlp_out",), {}))
            op = op.removeprefix("AllReduce")
        out.append(("Add", (p + "mlp_out", residual), (p + "hidden",), {}))
        out.append((op, (p + "hidden", "", w), (*outputs[:-1], p + "hidden.residual"), attrs))
        renames[p + "hidden"] = p + "hidden.residual"
    return out


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("passes", ["all", "none"])
@pytest.mark.parametrize("tp", [1, 2])
def test_the_vision_graph_is_qwen3s_plus_the_image_rows(spec_name: str, passes: str, tp: int) -> None:
    """Without the vision nodes and mrope_section, the VL graph is Qwen3's graph of the same decoder, node
    for node; fused, but for the residual sums of layers < D, which cannot fold into the next norm."""
    spec = SPECS[spec_name]()
    vl, text = _graph(spec, tp, passes), _graph(text_only(spec), tp, passes)
    assert vl.weights.keys() == text.weights.keys() and vl.weight_tensors == text.weight_tensors
    want = _strip_vision(text)
    if passes == "all":
        want = _unfold_layer_ends(want, spec.vision.deepstack_layers)
    assert _strip_vision(vl) == want


def test_a_qwen3_graph_has_no_vision_parts() -> None:
    """Byte-identical ONNX before and after this change was checked by hashing (commit message); here:
    the contract's Qwen3 inputs, no ScatterND, no mrope_section, no vision metadata."""
    for spec in (text_only(vl_dense()), text_only(vl_moe())):
        for passes in ("all", "none"):
            graph = _graph(spec, 1, passes)
            assert graph.inputs[-1] == "logits_indices" and graph.types["positions"].shape == ("T",)
            assert not any(n.op_type == "ScatterND" or "mrope_section" in n.attrs for n in graph.nodes)
            assert "vision" not in graph.metadata


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"mrope_section": (3, 3, 3)},
            r"mrope_section \[3, 3, 3\] must be three non-negative sizes summing to head_dim / 2 = 8",
        ),
        ({"mrope_section": (4, 5, -1)}, "non-negative"),
        ({"deepstack_layers": 4}, "deepstack_layers 4 is not between 0 and the 3 decoder layers"),
    ],
)
def test_vision_parts_that_do_not_fit_the_decoder_are_plan_errors(changes: dict, message: str) -> None:
    spec = vl_dense()
    bad = dataclasses.replace(spec, vision=dataclasses.replace(spec.vision, **changes))
    with pytest.raises(PlanError, match=message):
        build_graph(bad, recipe("bf16"))


@pytest.mark.parametrize(
    ("spec_name", "tp", "passes"), [(s, tp, p) for s in SPECS for tp in (1, 2) for p in ("all", "none")]
)
def test_vision_graph_exports_and_passes_the_checker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op_schemas: None, spec_name: str, tp: int, passes: str
) -> None:
    graph = _graph(SPECS[spec_name](dtype="float16"), tp, passes, rec="bf16")
    locations, _ = write_weights(graph, tmp_path)
    model = to_onnx(graph, locations)
    monkeypatch.chdir(tmp_path)
    onnx.checker.check_model(model, full_check=True, check_custom_domain=True)  # shape inference included
    inputs = {i.name: i.type.tensor_type for i in model.graph.input}
    dims = {name: [d.dim_param or d.dim_value for d in t.shape.dim] for name, t in inputs.items()}
    assert list(inputs)[-2:] == ["vision_rows", "vision_embeds"]
    assert dims["positions"] == [3, "T"] and dims["vision_rows"] == ["Nv", 1] and dims["vision_embeds"] == ["Nv", 144]
    assert inputs["vision_embeds"].elem_type == TensorProto.FLOAT16
    assert inputs["vision_rows"].elem_type == TensorProto.INT64
    ropes = [n for n in model.graph.node if n.op_type in ROPE_OPS]
    assert ropes
    for node in ropes:
        (attr,) = [a for a in node.attribute if a.name == "mrope_section"]
        assert attr.type == onnx.AttributeProto.INTS and list(attr.ints) == list(MROPE_SECTION)
    reductions = [helper.get_attribute_value(n.attribute[0]) for n in model.graph.node if n.op_type == "ScatterND"]
    assert reductions == [b"none", b"add", b"add"]
    props = {p.key: p.value for p in model.metadata_props}
    assert props["vision"] == "mrope_section=[3, 3, 2]/deepstack_layers=2"
    assert props["architecture"] == SPECS[spec_name]().architecture
