"""Graph initializers as torch tensors: external data mapped from the safetensors shards.

Each initializer of graph.onnx names its bytes (file, offset, length). On the CPU the shard is
memory-mapped once and each weight is a view into it: the engine reads weights from the page cache.
On a GPU each weight gets its own device tensor and weight_reader fills them all, reading the files
in large chunks into a ring of pinned buffers, copies to the device overlapped with the reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container
from pathlib import Path

import onnx
import torch
from onnx import numpy_helper

from qruntime.artifact import ArtifactFormatError, artifact_path
from qruntime.weight_reader import Extent, read_extents

ONNX_TO_TORCH = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.FLOAT8E4M3FN: torch.float8_e4m3fn,
    onnx.TensorProto.FLOAT8E4M3FNUZ: torch.float8_e4m3fnuz,  # amd-gfx942 artifacts' weights (qruntime.target)
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.UINT8: torch.uint8,
}


FP8_WEIGHTS = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _mapped(path: Path, cache: dict[Path, torch.Tensor]) -> torch.Tensor:
    if path not in cache:
        storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=path.stat().st_size)
        cache[path] = torch.empty(0, dtype=torch.uint8).set_(storage)
    return cache[path]


def external_extent(
    root: Path, init: onnx.TensorProto, dtype: torch.dtype, listed: Container[str] | None
) -> tuple[Path, int, int]:
    """(file, offset, length) of an initializer's external data, checked before any byte is read or
    allocated: the file confined to the artifact and listed by its manifest (artifact_path), the
    length that of the shape (in Python integers: a huge shape cannot wrap around), the bytes inside
    the file."""
    where = f"graph initializer {init.name[:200]!r}"
    info = {entry.key: entry.value for entry in init.external_data}
    if "location" not in info or "length" not in info:
        raise ArtifactFormatError(f"{where}: its external data names no location or no length")
    path = artifact_path(root, info["location"], listed=listed)
    try:
        offset, length = int(info.get("offset", "0")), int(info["length"])
    except ValueError:
        raise ArtifactFormatError(f"{where}: external data offset / length are not integers") from None
    shape = list(init.dims)
    if any(d < 0 for d in shape):
        raise ArtifactFormatError(f"{where}: negative dimension in shape {shape}")
    expected = math.prod(shape) * dtype.itemsize
    if length != expected:
        raise ArtifactFormatError(f"{where}: {length} bytes for shape {shape} of {dtype} (expected {expected})")
    size = path.stat().st_size
    if offset < 0 or offset + length > size:
        raise ArtifactFormatError(
            f"{path}: initializer {init.name[:200]!r} needs bytes {offset}..{offset + length} but the file has "
            f"{size} (truncated?)"
        )
    return path, offset, length


def _inline(init: onnx.TensorProto) -> torch.Tensor:
    try:
        return torch.from_numpy(numpy_helper.to_array(init).copy())
    except (ValueError, TypeError) as exc:  # dims that the stored values do not fill
        raise ArtifactFormatError(f"graph initializer {init.name[:200]!r}: {exc}") from None


def runtime_dtype(dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """What a stored initializer dtype becomes at run time: floating weights that are not FP8 take
    `compute_dtype`; FP8 weights and integer constants keep their type."""
    return compute_dtype if dtype.is_floating_point and dtype not in FP8_WEIGHTS else dtype


def load_initializers(
    root: str | Path | None,
    graph: onnx.GraphProto,
    device: torch.device,
    compute_dtype: torch.dtype,
    external: Callable[[onnx.TensorProto, torch.dtype], torch.Tensor] | None = None,
    *,
    listed: Container[str] | None = None,
) -> dict[str, torch.Tensor]:
    """name -> tensor on `device` in its `runtime_dtype` for every initializer. The external ones
    (weight-file bytes) are mapped from the files under `root`, or made by `external(init, dtype)`
    instead (a synthetic artifact's random weights); small inline constants are read as written.
    With `root`, every external initializer is first checked against its file (external_extent;
    `listed`: the manifest's files, the only ones it may name), the made ones too."""
    files: dict[Path, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    reads: list[Extent] = []  # on a GPU: read by weight_reader after the loop, into `out`'s tensors
    for init in graph.initializer:
        dtype = ONNX_TO_TORCH.get(init.data_type)
        if dtype is None:
            raise ArtifactFormatError(f"graph.onnx initializer {init.name!r} has unsupported type {init.data_type}")
        if init.data_location != onnx.TensorProto.EXTERNAL:
            tensor = _inline(init)
        elif root is None and external is not None:
            tensor = external(init, dtype)
        elif root is None:
            raise ValueError(
                f"initializer {init.name!r} is in a weight file: load_initializers needs the artifact's root"
            )
        else:
            path, offset, length = external_extent(Path(root), init, dtype, listed)
            if external is not None:
                tensor = external(init, dtype)
            elif device.type == "cuda":
                out[init.name] = torch.empty(list(init.dims), dtype=dtype, device=device)
                reads.append(Extent(init.name, path, offset, length))
                continue
            else:
                tensor = _mapped(path, files)[offset : offset + length].view(dtype).reshape(list(init.dims))
        out[init.name] = tensor.to(runtime_dtype(dtype, compute_dtype)).to(device)
    read_extents(reads, {e.key: out[e.key] for e in reads})
    for extent in reads:
        tensor = out[extent.key]
        out[extent.key] = tensor.to(runtime_dtype(tensor.dtype, compute_dtype))
    return out
