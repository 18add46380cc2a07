"""Safetensors shards of random tensors, and each tensor's byte range in its file: inputs for the
weight reader's tests (tests/runtime/test_weight_reader.py, tests/gpu/test_weight_reader.py)."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import torch
from qruntime.weight_reader import Extent
from safetensors.torch import save_file

DTYPES = (torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.uint8, torch.int32)


def random_tensor(rng: random.Random, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    bits = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8)
    return bits[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).reshape(shape).clone()


def write_shard(path: Path, rng: random.Random, count: int) -> dict[str, torch.Tensor]:
    """A safetensors shard of `count` random tensors, named after the file."""
    tensors = {}
    for i in range(count):
        dtype = rng.choice(DTYPES)
        shape = rng.choice(
            [[rng.randrange(1, 9)], [rng.randrange(1, 40), rng.randrange(1, 70)], [0, 3], [rng.randrange(200, 900), 37]]
        )
        tensors[f"{path.stem}.t{i}.w"] = random_tensor(rng, shape, dtype)
    save_file(tensors, str(path))
    return tensors


def extents_of(path: Path) -> list[Extent]:
    """Each tensor's absolute byte range, from the safetensors header."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    base = 8 + header_len
    return [
        Extent(name, path, base + info["data_offsets"][0], info["data_offsets"][1] - info["data_offsets"][0])
        for name, info in header.items()
        if name != "__metadata__"
    ]
