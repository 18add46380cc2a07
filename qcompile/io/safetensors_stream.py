"""Streaming access to safetensors files: header parsing, row-range reads and positional writes.

The `safetensors` library reads through mmap (every touched page stays resident) and writes whole
dicts of tensors at once; a compile that must stay within a fixed memory budget whatever the model's
size needs neither. The format is small — an 8-byte little-endian header length, a JSON header
mapping names to dtype/shape/data_offsets, then the raw bytes — so reads here are plain `pread`s of
row ranges and writes are `pwrite`s at offsets fixed by a header written first.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
from qruntime import bounded_json
from qruntime.shown import shown

from qcompile.errors import CheckpointError
from qcompile.io.frontier_hash import FrontierHasher

# safetensors dtype name <-> torch dtype
DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "BF16": torch.bfloat16,
        "F16": torch.float16,
        "F32": torch.float32,
        "F64": torch.float64,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E4M3FNUZ": torch.float8_e4m3fnuz,  # the amd-gfx942 target's FP8 (qruntime.target)
        "F8_E5M2": torch.float8_e5m2,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }
)
DTYPE_NAMES: Mapping[torch.dtype, str] = MappingProxyType({v: k for k, v in DTYPES.items()})
MAX_HEADER = 100_000_000  # bytes of JSON header: the safetensors library's own limit
MAX_DIMS = 64  # a tensor's rank at most (torch's limit)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes live in a safetensors file."""

    name: str
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def row_bytes(self) -> int:
        """Bytes of one slice along dim 0."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along dim 0, read with one pread (no mmap, nothing kept resident)."""
        shape = (stop - start, *self.shape[1:]) if self.shape else ()
        count = (stop - start) * self.row_bytes if self.shape else self.nbytes
        offset = self.begin + (start * self.row_bytes if self.shape else 0)
        buffer = torch.empty(count, dtype=torch.uint8)  # not zero-filled, unlike bytearray
        view = memoryview(buffer.numpy())
        with open(self.file, "rb", buffering=0) as handle:
            done = 0
            while done < count:
                got = os.preadv(handle.fileno(), [view[done:]], offset + done)
                if got == 0:
                    raise CheckpointError(
                        f"{self.file.name}: unexpected end of file while reading tensor {self.name!r}"
                    )
                done += got
        return buffer.view(self.torch_dtype).reshape(shape)

    def read(self) -> torch.Tensor:
        return self.read_rows(0, self.shape[0]) if self.shape else self.read_rows(0, 0)


def read_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Parse and check a safetensors header against the file's size: (entries, metadata).

    A truncated file, a header longer than MAX_HEADER (safetensors' own limit) or nested past
    qruntime.bounded_json's depth, one that does not parse, entries of the wrong types, offsets
    outside the file, overlapping tensors or a byte count that does not match dtype x shape are
    errors naming the file and tensor. Only the 8-byte length and then at most MAX_HEADER bytes are read.
    """
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path.name}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER:
            raise CheckpointError(
                f"{path.name}: safetensors header length {header_len} is over the {MAX_HEADER}-byte limit "
                "(a corrupt file, or not safetensors)"
            )
        if header_len > size - 8:
            raise CheckpointError(
                f"{path.name}: truncated or corrupt safetensors file (header of {header_len} bytes "
                f"in a file of {size} bytes)"
            )
        raw = handle.read(header_len)
    try:
        header = bounded_json.loads(raw, what=f"{path.name}: safetensors header")
    except bounded_json.JSONLimitError as exc:
        raise CheckpointError(str(exc)) from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer past Python's 4300 digits
        raise CheckpointError(f"{path.name}: safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path.name}: safetensors __metadata__ must map names to strings")
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        dtype, shape, begin, end = _entry_fields(path, name, info)
        expected = math.prod(shape) * DTYPES[dtype].itemsize
        if end - begin != expected:
            raise CheckpointError(
                f"{path.name}: tensor {shown(name)} spans {end - begin} bytes but {dtype} x {list(shape)} "
                f"needs {expected}"
            )
        if data_start + end > size:
            raise CheckpointError(
                f"{path.name}: truncated file: tensor {shown(name)} ends at byte {data_start + end} "
                f"but the file has {size} bytes"
            )
        entries[name] = TensorEntry(name, path, dtype, shape, data_start + begin, data_start + end)
    spans = sorted((e.begin, e.end, e.name) for e in entries.values() if e.nbytes)
    for (_, end_a, name_a), (begin_b, _, name_b) in zip(spans, spans[1:], strict=False):
        if begin_b < end_a:
            raise CheckpointError(f"{path.name}: tensors {shown(name_a)} and {shown(name_b)} overlap")
    return entries, metadata


def _entry_fields(path: Path, name: str, info: object) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, each of the type and range the format allows."""
    where = f"{path.name}: header entry for tensor {shown(name)}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise CheckpointError(f"{where} must be an object with dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointError(f"{path.name}: tensor {shown(name)} has unknown dtype {shown(dtype)}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_u64(d) for d in shape):
        raise CheckpointError(
            f"{where}: shape must list at most {MAX_DIMS} integers from 0 to 2**63-1, got {shown(shape)}"
        )
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_u64(o) for o in offsets):
        raise CheckpointError(f"{where}: data_offsets must be two integers from 0 to 2**63-1, got {shown(offsets)}")
    begin, end = offsets
    if begin > end:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] end before they begin")
    return dtype, tuple(shape), begin, end


def _is_u64(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


@dataclass(frozen=True)
class OutputTensor:
    """One tensor to be written by a StreamingWriter."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class StreamingWriter:
    """Writes a safetensors file whose header is fixed up front; tensor bytes arrive in any order.

    `write` is a positional write, safe to call from several threads at once. The file is sized
    at creation, so a writer killed half-way leaves a file of the right size with holes: callers
    write into a temporary directory and only publish it when every byte is in.
    """

    def __init__(
        self,
        path: Path,
        tensors: list[OutputTensor],
        metadata: dict[str, str] | None = None,
        hash_while_writing: bool = False,
    ):
        self.path = path
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        offset = 0
        self._offsets: dict[str, tuple[int, OutputTensor]] = {}
        for tensor in tensors:
            if tensor.name in self._offsets:
                raise ValueError(f"tensor {tensor.name!r} listed twice for {path.name}")
            header[tensor.name] = {
                "dtype": DTYPE_NAMES[tensor.dtype],
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + tensor.nbytes],
            }
            self._offsets[tensor.name] = (offset, tensor)
            offset += tensor.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer does
        self.data_start = 8 + len(raw)
        self.size = self.data_start + offset
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self._fd, struct.pack("<Q", len(raw)) + raw, 0)
        os.ftruncate(self._fd, self.size)
        self._hasher = FrontierHasher(path, self.size) if hash_while_writing else None
        if self._hasher is not None:
            self._hasher.mark(0, self.data_start)

    def write(self, name: str, byte_offset: int, data: torch.Tensor) -> None:
        """Write `data`'s bytes at `byte_offset` within tensor `name`."""
        offset, tensor = self._offsets[name]
        if data.dtype != tensor.dtype:
            raise TypeError(f"{name}: writing {data.dtype} into a {tensor.dtype} tensor")
        view = memoryview(data.contiguous().reshape(-1).view(torch.uint8).numpy())
        if byte_offset + len(view) > tensor.nbytes:
            raise ValueError(f"{name}: write past the end of the tensor")
        start = position = self.data_start + offset + byte_offset
        while view:
            done = os.pwrite(self._fd, view, position)
            view, position = view[done:], position + done
        if self._hasher is not None:
            self._hasher.mark(start, position)

    def sha256(self) -> str:
        """The file's sha256 (with `hash_while_writing`), once every byte has been written."""
        if self._hasher is None:
            raise RuntimeError("StreamingWriter was created without hash_while_writing")
        return self._hasher.result()

    def abort(self) -> None:
        """Stop hashing an incomplete file and close it."""
        if self._hasher is not None:
            self._hasher.cancel()
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
