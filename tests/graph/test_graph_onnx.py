"""ONNX export: checker-clean models whose weights are external data in real safetensors files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from graph_helpers import PASS_NAMES, aligned_spec, dense_spec, moe_spec, recipe, write_weights
from onnx import TensorProto, numpy_helper

from qcompile.errors import ArtifactError
from qcompile.graph import TensorLocation, compile_graph, to_onnx, write_onnx

SPECS = {
    "dense": dense_spec(),
    "dense-tied": dense_spec(tied=True),
    "moe": moe_spec(),
    "moe-f16": moe_spec(dtype="float16"),
    "aligned": aligned_spec(),
    "aligned-moe": aligned_spec(moe=True),
    "dense-f32": dense_spec(dtype="float32"),
}
CASES = [
    (spec, rec, passes)
    for spec in ("dense", "dense-tied", "moe", "moe-f16", "dense-f32")
    for rec in ("ptpc-fp8", "bf16", "ptpc-fp8-lmhead")
    for passes in ("all", "none")
] + [(spec, "block-fp8", passes) for spec in ("aligned", "aligned-moe") for passes in ("all", "none")]


def _graph(spec: str, rec: str, passes: str):
    return compile_graph(SPECS[spec], recipe(rec, passes=PASS_NAMES if passes == "all" else ()))


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(("spec", "rec", "passes"), CASES)
def test_export_passes_the_checker_and_points_at_the_written_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op_schemas: None, spec: str, rec: str, passes: str
) -> None:
    graph = _graph(spec, rec, passes)
    locations, tensors = write_weights(graph, tmp_path)
    model = to_onnx(graph, locations)
    monkeypatch.chdir(tmp_path)  # an in-memory model's external data resolves from the working directory
    onnx.checker.check_model(model)
    onnx.checker.check_model(model, full_check=True, check_custom_domain=True)
    path = tmp_path / "graph.onnx"
    write_onnx(graph, locations, path)
    onnx.checker.check_model(str(path), full_check=True, check_custom_domain=True)

    initializers = {init.name: init for init in model.graph.initializer}
    assert len(initializers) == len(model.graph.initializer)
    assert set(initializers) == set(graph.weight_tensors) | set(graph.constants)
    for name, loc in locations.items():
        init = initializers[name]
        assert init.data_location == TensorProto.EXTERNAL and not init.HasField("raw_data")
        assert {e.key: e.value for e in init.external_data} == {
            "location": loc.file,
            "offset": str(loc.offset),
            "length": str(loc.length),
        }
        with open(tmp_path / loc.file, "rb") as handle:
            handle.seek(loc.offset)
            assert handle.read(loc.length) == _bytes(tensors[name])
    loaded = onnx.load(str(path))  # reads every weight through its external data entry
    for init in loaded.graph.initializer:
        if init.name in tensors:
            assert init.raw_data == _bytes(tensors[init.name])
            assert list(init.dims) == list(tensors[init.name].shape)
        else:
            np.testing.assert_array_equal(numpy_helper.to_array(init), graph.constants[init.name])


def test_float_weights_read_back_as_values(tmp_path: Path) -> None:
    graph = _graph("dense-f32", "bf16", "all")
    locations, tensors = write_weights(graph, tmp_path, files=1)
    write_onnx(graph, locations, tmp_path / "graph.onnx")
    loaded = onnx.load(str(tmp_path / "graph.onnx"))
    for init in loaded.graph.initializer:
        if init.name in tensors:
            np.testing.assert_array_equal(numpy_helper.to_array(init), tensors[init.name].numpy())


def test_graph_inputs_outputs_and_value_types_in_onnx(tmp_path: Path) -> None:
    graph = _graph("moe", "ptpc-fp8", "all")
    model = to_onnx(graph, write_weights(graph, tmp_path)[0])

    def sig(vi: onnx.ValueInfoProto) -> tuple[str, int, list[object]]:
        dims = [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
        return vi.name, vi.type.tensor_type.elem_type, dims

    assert [sig(vi) for vi in model.graph.input] == [
        ("input_ids", TensorProto.INT64, ["T"]),
        ("positions", TensorProto.INT64, ["T"]),
        ("slot_mapping", TensorProto.INT64, ["T"]),
        ("block_tables", TensorProto.INT32, ["B", "max_blocks"]),
        ("context_lens", TensorProto.INT32, ["B"]),
        ("query_start_loc", TensorProto.INT32, ["B+1"]),
        ("logits_indices", TensorProto.INT64, ["B"]),
    ]
    assert [sig(vi) for vi in model.graph.output] == [("logits", TensorProto.BFLOAT16, ["B", 97])]
    info = {vi.name: sig(vi) for vi in model.graph.value_info}
    assert info["layers.1.kv_ready"] == ("layers.1.kv_ready", TensorProto.UINT8, [0])
    assert info["layers.0.attn_norm.q"] == ("layers.0.attn_norm.q", TensorProto.FLOAT8E4M3FN, ["T", 48])
    assert info["layers.0.attn_norm.scale"] == ("layers.0.attn_norm.scale", TensorProto.FLOAT, ["T", 1])
    produced = {out for node in model.graph.node for out in node.output} - {"logits"}
    assert set(info) == produced
    assert {(o.domain, o.version) for o in model.opset_import} == {("", 23), ("qcompile", 1)}
    assert all(node.domain in ("", "qcompile") for node in model.graph.node)
    assert model.ir_version == 11
    props = {p.key: p.value for p in model.metadata_props}
    assert props["architecture"] == "Qwen3MoeForCausalLM"
    assert props["passes"] == ",".join(PASS_NAMES)
    assert "Qwen3MoeForCausalLM" in model.doc_string


def test_tied_embedding_is_stored_once_and_read_twice(tmp_path: Path) -> None:
    graph = _graph("dense-tied", "ptpc-fp8", "all")
    model = to_onnx(graph, write_weights(graph, tmp_path)[0])
    names = [init.name for init in model.graph.initializer]
    assert names.count("model.embed_tokens.weight") == 1
    readers = [node.op_type for node in model.graph.node if "model.embed_tokens.weight" in node.input]
    assert readers == ["Gather", "Gemm"]


def test_the_checker_sees_a_broken_custom_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op_schemas: None
) -> None:
    graph = _graph("dense", "ptpc-fp8", "all")
    model = to_onnx(graph, write_weights(graph, tmp_path)[0])
    monkeypatch.chdir(tmp_path)
    node = next(n for n in model.graph.node if n.op_type == "QKNormRoPEKVWrite")
    kept = [a for a in node.attribute if a.name != "theta"]
    del node.attribute[:]
    node.attribute.extend(kept)
    with pytest.raises(onnx.checker.ValidationError, match="theta"):
        onnx.checker.check_model(model, check_custom_domain=True)


def _bad(locations: dict[str, TensorLocation], name: str, **changes: object) -> dict[str, TensorLocation]:
    return {**locations, name: dataclasses.replace(locations[name], **changes)}


def test_locations_that_do_not_match_the_graph_are_artifact_errors(tmp_path: Path) -> None:
    graph = _graph("dense", "ptpc-fp8", "all")
    locations, _ = write_weights(graph, tmp_path)
    name = "model.layers.0.self_attn.qkv_proj.weight_scale"
    missing = {k: v for k, v in locations.items() if k != name}
    with pytest.raises(ArtifactError, match=name):
        to_onnx(graph, missing)
    with pytest.raises(ArtifactError, match=f"{name}.*written as"):
        to_onnx(graph, _bad(locations, name, shape=(1, 192)))
    with pytest.raises(ArtifactError, match=f"{name}.*written as"):
        to_onnx(graph, _bad(locations, name, dtype=torch.float32))
    with pytest.raises(ArtifactError, match="length"):
        to_onnx(graph, _bad(locations, name, length=locations[name].length + 2))
    for file in ("../outside.safetensors", "/abs/w.safetensors"):
        with pytest.raises(ArtifactError, match="relative path inside the artifact"):
            to_onnx(graph, _bad(locations, name, file=file))
