"""ONNX export: a Graph as graph.onnx, its weights external initializers pointing into safetensors files.

Nothing is copied: each weight initializer carries only (location, offset, length) into the artifact's
`weights/*.safetensors`, so `onnx.load(..., load_external_data=False)` and `onnx.checker` work and the
bytes exist once. Reshape shapes and Split sizes are small int64 initializers embedded in the file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import MappingProxyType

import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

import qcompile
from qcompile.errors import ArtifactError
from qcompile.graph.ir import Graph, Node, TensorType, check_graph
from qcompile.graph.ops import DOMAIN, DOMAIN_VERSION, OPSET

ONNX_DTYPES = MappingProxyType(
    {
        torch.bfloat16: TensorProto.BFLOAT16,
        torch.float16: TensorProto.FLOAT16,
        torch.float32: TensorProto.FLOAT,
        torch.float8_e4m3fn: TensorProto.FLOAT8E4M3FN,
        torch.float8_e4m3fnuz: TensorProto.FLOAT8E4M3FNUZ,
        torch.int64: TensorProto.INT64,
        torch.int32: TensorProto.INT32,
        torch.uint8: TensorProto.UINT8,
    }
)


@dataclass(frozen=True)
class TensorLocation:
    """Where the writer put one tensor: `file` relative to the artifact dir (POSIX separators), the
    absolute byte `offset` of its data in that file, and its byte `length`, dtype and shape."""

    file: str
    offset: int
    length: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def to_onnx(
    graph: Graph, locations: Mapping[str, TensorLocation], metadata: Mapping[str, str] | None = None
) -> onnx.ModelProto:
    """The ModelProto of `graph`; `locations` maps every weight tensor name to where its bytes are;
    `metadata` adds model properties (a tensor-parallel rank's graph: its `rank`).

    Raises ArtifactError when a weight has no location, or one whose dtype, shape or length disagrees
    with what the graph's weight jobs produce.
    """
    check_graph(graph)
    initializers = [_external(name, t, locations.get(name)) for name, t in graph.weight_tensors.items()]
    initializers += [numpy_helper.from_array(array, name) for name, array in graph.constants.items()]
    outputs = set(graph.outputs)
    value_info = [
        _value_info(out, graph.types[out]) for node in graph.nodes for out in node.outputs if out not in outputs
    ]
    body = helper.make_graph(
        [_node(node) for node in graph.nodes],
        f"{graph.spec.architecture} decoder step",
        [_value_info(name, graph.types[name]) for name in graph.inputs],
        [_value_info(name, graph.types[name]) for name in graph.outputs],
        initializer=initializers,
        value_info=value_info,
    )
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)]
    model = helper.make_model(
        body,
        opset_imports=opsets,
        producer_name="qcompile",
        producer_version=qcompile.__version__,
        doc_string=f"{graph.spec.architecture} compiled by qcompile {qcompile.__version__}: one forward step over "
        "a flattened batch of tokens; weights are external data in weights/*.safetensors.",
    )
    model.ir_version = helper.find_min_ir_version_for(opsets, ignore_unknown=True)
    metadata = {
        **graph.metadata,
        "architecture": graph.spec.architecture,
        "model_dtype": graph.spec.dtype,
        "passes": ",".join(graph.applied_passes),
        **(metadata or {}),
    }
    helper.set_model_props(model, metadata)
    return model


def write_onnx(
    graph: Graph, locations: Mapping[str, TensorLocation], path: Path | str, metadata: Mapping[str, str] | None = None
) -> onnx.ModelProto:
    """Write `graph` to `path` as ONNX (external data locations are relative to path's directory)."""
    model = to_onnx(graph, locations, metadata)
    Path(path).write_bytes(model.SerializeToString())
    return model


def _node(node: Node) -> onnx.NodeProto:
    attrs = {key: list(value) if isinstance(value, tuple) else value for key, value in node.attrs.items()}
    return helper.make_node(
        node.op_type, list(node.inputs), list(node.outputs), name=node.name, domain=node.domain, **attrs
    )


def _value_info(name: str, t: TensorType) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, ONNX_DTYPES[t.dtype], list(t.shape))


def _external(name: str, expected: TensorType, loc: TensorLocation | None) -> TensorProto:
    """An initializer whose data lives at `loc` (checked against the type the graph expects)."""
    if loc is None:
        raise ArtifactError(f"graph.onnx: weight {name!r} has no location in the written weight files")
    if loc.dtype != expected.dtype or tuple(loc.shape) != expected.shape:
        raise ArtifactError(
            f"graph.onnx: weight {name!r} was written as {loc.dtype} {list(loc.shape)}, but the graph reads "
            f"{expected.dtype} {list(expected.shape)}"
        )
    if loc.length != math.prod(loc.shape) * loc.dtype.itemsize or loc.offset < 0:
        raise ArtifactError(
            f"graph.onnx: weight {name!r}: offset {loc.offset} / length {loc.length} do not fit "
            f"{loc.dtype} {list(loc.shape)}"
        )
    relative = PurePosixPath(loc.file)
    if relative.is_absolute() or ".." in relative.parts or "\\" in loc.file or not loc.file:
        raise ArtifactError(
            f"graph.onnx: weight {name!r}: file {loc.file!r} must be a relative path inside the artifact"
        )
    tensor = TensorProto(name=name, data_type=ONNX_DTYPES[loc.dtype], dims=list(loc.shape))
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", str(relative)), ("offset", str(loc.offset)), ("length", str(loc.length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor
