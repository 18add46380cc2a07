"""Graph initializers as torch tensors: external data mapped from the safetensors shards.

Each initializer of graph.onnx names its bytes (file, offset, length). The shard is memory-mapped
once and each weight is a view into it, so a CPU engine reads weights from the page cache and a GPU
engine copies them straight from the mapping to the device, with no host copy in between.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx
import torch
from onnx import numpy_helper

from qruntime.artifact import ArtifactFormatError, check_relative_path

ONNX_TO_TORCH = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.FLOAT8E4M3FN: torch.float8_e4m3fn,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.UINT8: torch.uint8,
}


def _mapped(root: Path, location: str, cache: dict[str, torch.Tensor]) -> torch.Tensor:
    if location not in cache:
        path = root / check_relative_path(location)
        if not path.is_file():
            raise ArtifactFormatError(f"{path}: weight file named by graph.onnx is missing")
        size = path.stat().st_size
        storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
        cache[location] = torch.empty(0, dtype=torch.uint8).set_(storage)
    return cache[location]


def _external(root: Path, init: onnx.TensorProto, dtype: torch.dtype, files: dict[str, torch.Tensor]) -> torch.Tensor:
    info = {entry.key: entry.value for entry in init.external_data}
    data = _mapped(root, info["location"], files)
    offset, length = int(info.get("offset", 0)), int(info["length"])
    shape = list(init.dims)
    expected = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    if length != expected:
        raise ArtifactFormatError(
            f"graph.onnx initializer {init.name!r}: {length} bytes for shape {shape} of {dtype} (expected {expected})"
        )
    if offset + length > data.numel():
        raise ArtifactFormatError(
            f"{info['location']}: initializer {init.name!r} needs bytes {offset}..{offset + length} but the file "
            f"has {data.numel()} (truncated?)"
        )
    return data[offset : offset + length].view(dtype).reshape(shape)


def runtime_dtype(dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """What a stored initializer dtype becomes at run time: floating weights that are not FP8 take
    `compute_dtype`; FP8 weights and integer constants keep their type."""
    return compute_dtype if dtype.is_floating_point and dtype != torch.float8_e4m3fn else dtype


def load_initializers(
    root: str | Path | None,
    graph: onnx.GraphProto,
    device: torch.device,
    compute_dtype: torch.dtype,
    external: Callable[[onnx.TensorProto, torch.dtype], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """name -> tensor on `device` in its `runtime_dtype` for every initializer. The external ones
    (weight-file bytes) are mapped from the files under `root`, or made by `external(init, dtype)`
    instead (a synthetic artifact's random weights); small inline constants are read as written."""
    files: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for init in graph.initializer:
        dtype = ONNX_TO_TORCH.get(init.data_type)
        if dtype is None:
            raise ArtifactFormatError(f"graph.onnx initializer {init.name!r} has unsupported type {init.data_type}")
        if init.data_location != onnx.TensorProto.EXTERNAL:
            tensor = torch.from_numpy(numpy_helper.to_array(init).copy())
        elif external is not None:
            tensor = external(init, dtype)
        elif root is None:
            raise ValueError(
                f"initializer {init.name!r} is in a weight file: load_initializers needs the artifact's root"
            )
        else:
            tensor = _external(Path(root), init, dtype, files)
        out[init.name] = tensor.to(runtime_dtype(dtype, compute_dtype)).to(device)
    return out
