"""qruntime.weight_reader: every tensor read through the chunked, threaded pipeline equals
safetensors' own read of it (odd sizes, every dtype the artifacts hold, many small tensors, chunks
far smaller than the tensors and tensors smaller than the chunks), a file that ends early is refused
naming it, and no reader thread outlives a read. On the CPU the pipeline copies synchronously; the
GPU tier runs the pinned, asynchronous path (tests/gpu/test_weight_reader.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from qruntime.artifact import ArtifactFormatError
from qruntime.weight_reader import Extent, plan_chunks, read_extents
from safetensors import safe_open
from safetensors.torch import save_file
from weight_shards import extents_of, random_tensor, write_shard


def destinations(path: Path, extents: list[Extent]) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {e.key: torch.empty_like(f.get_tensor(e.key)) for e in extents}


@pytest.mark.parametrize("chunk_bytes, readers, buffers", [(4093, 3, 2), (1 << 20, 1, 1), (65536, 4, 8)])
def test_every_tensor_equals_safetensors_read(tmp_path, rng, chunk_bytes, readers, buffers):
    paths = [tmp_path / f"model-{i}.safetensors" for i in range(2)]
    want = {}
    for path in paths:
        want |= write_shard(path, rng, rng.randrange(40, 120))
    extents = [e for path in paths for e in extents_of(path)]
    rng.shuffle(extents)
    dst = {k: v for path in paths for k, v in destinations(path, extents_of(path)).items()}
    for tensor in dst.values():
        tensor.view(-1).view(torch.uint8).fill_(0xA5)  # what a missed byte would keep
    read = read_extents(extents, dst, chunk_bytes=chunk_bytes, readers=readers, buffers=buffers)
    assert read == sum(e.length for e in extents)
    for name, tensor in want.items():
        assert torch.equal(dst[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_many_small_tensors(tmp_path, rng):
    path = tmp_path / "small.safetensors"
    want = {f"n{i}": random_tensor(rng, [rng.randrange(1, 5)], torch.bfloat16) for i in range(3000)}
    save_file(want, str(path))
    extents = extents_of(path)
    dst = destinations(path, extents)
    read_extents(extents, dst, chunk_bytes=8192)
    assert all(torch.equal(dst[k].view(torch.uint8), v.view(torch.uint8)) for k, v in want.items())


def test_the_plan_covers_every_byte_once(rng):
    """Random extents, some overlapping (tied weights name the same bytes), some far apart: every
    byte of every extent lands in exactly one piece, at its place in the tensor and the chunk."""
    path = Path("/nonexistent")
    extents = []
    for i in range(200):
        offset = rng.randrange(0, 1 << 22)
        extents.append(Extent(i, path, offset, rng.randrange(0, 50000)))
    extents.append(Extent("tied", path, extents[0].offset, extents[0].length))
    chunk_bytes = rng.choice([1000, 4096, 65536])
    chunks = plan_chunks(extents, chunk_bytes, gap=rng.choice([0, 100, 1 << 20]))
    seen = {e.key: bytearray(e.length) for e in extents}
    for chunk in chunks:
        assert 0 < chunk.length <= chunk_bytes
        for key, at, start, n in chunk.pieces:
            extent = next(e for e in extents if e.key == key)
            assert extent.offset + at == chunk.offset + start and start >= 0 and start + n <= chunk.length
            for b in range(at, at + n):
                seen[key][b] += 1
    assert all(all(c == 1 for c in counts) for counts in seen.values())


def test_a_file_that_ends_early_is_refused_and_no_reader_is_left(tmp_path, rng):
    path = tmp_path / "model.safetensors"
    write_shard(path, rng, 60)
    extents = extents_of(path)
    dst = destinations(path, extents)
    last = max(extents, key=lambda e: (e.offset + e.length, e.length))  # not an empty tensor at the end
    with open(path, "r+b") as f:
        f.truncate(last.offset + last.length // 2)  # cut inside the last tensor, after the plan's stat
    threads = threading.active_count()
    cut = last.offset + last.length // 2
    with pytest.raises(ArtifactFormatError, match=rf"{path}: ended at byte {cut}, before \d+ \(truncated"):
        read_extents(extents, dst, chunk_bytes=1024, readers=3, buffers=2)
    assert threading.active_count() == threads


def test_a_destination_of_another_size_is_refused(tmp_path, rng):
    path = tmp_path / "model.safetensors"
    write_shard(path, rng, 5)
    extents = extents_of(path)
    dst = destinations(path, extents)
    victim = next(e for e in extents if e.length > 1)
    dst[victim.key] = torch.empty(victim.length + 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"{victim.key}: the destination does not hold {victim.length} contiguous"):
        read_extents(extents, dst)
