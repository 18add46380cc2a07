"""Random weights, generated chunk by chunk and written straight into safetensors shards.

Each tensor is cut into chunks of whole rows of about CHUNK_ELEMENTS values; every chunk gets its
own torch.Generator seeded from (seed, tensor name, chunk index). The bytes therefore depend only
on the seed (on one torch installation), not on the number of threads or the order chunks finish
in, and chunks can be generated on every core at once. At most a few chunks per thread are alive
at any time, so memory stays bounded whatever the model's size.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from qcompile.io.safetensors_stream import OutputTensor, StreamingWriter

CHUNK_ELEMENTS = 1 << 21  # 4 MiB of bf16 per chunk; part of what fixes the bytes for a seed
LINEAR_STD = 0.02  # projections, router and embeddings: normal(0, 0.02), like initializer_range
NORM_STD = 0.05  # RMSNorm gains: 1 + normal(0, 0.05), so that mixing two norms up shows
MAX_THREADS = 16

Progress = Callable[[int], None]


@dataclass(frozen=True)
class Init:
    """How one tensor's values are drawn: normal(mean, std)."""

    mean: float
    std: float


def init_for(name: str) -> Init:
    """Norm weights (…norm.weight, …_layernorm.weight, the vision tower's …norm1 / norm2.weight) around 1,
    everything else (biases included) around 0."""
    if name.endswith(("norm.weight", "layernorm.weight", "norm1.weight", "norm2.weight")):
        return Init(1.0, NORM_STD)
    return Init(0.0, LINEAR_STD)


def chunk_seed(seed: int, name: str, chunk: int) -> int:
    """A 63-bit generator seed for one chunk, stable across runs and platforms."""
    digest = hashlib.blake2b(f"{seed}\0{name}\0{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def rows_per_chunk(shape: tuple[int, ...]) -> int:
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, CHUNK_ELEMENTS // max(row, 1))


def random_chunk(tensor: OutputTensor, seed: int, chunk: int) -> torch.Tensor:
    """Chunk `chunk` of `tensor`'s values: rows [chunk * rows_per_chunk, …) along dim 0."""
    rows = rows_per_chunk(tensor.shape)
    first_dim = tensor.shape[0] if tensor.shape else 1
    start, stop = chunk * rows, min((chunk + 1) * rows, first_dim)
    shape = (stop - start, *tensor.shape[1:]) if tensor.shape else ()
    init = init_for(tensor.name)
    generator = torch.Generator().manual_seed(chunk_seed(seed, tensor.name, chunk))
    return torch.empty(shape, dtype=tensor.dtype).normal_(init.mean, init.std, generator=generator)


def chunks_of(tensor: OutputTensor) -> Iterator[tuple[int, int]]:
    """(chunk index, byte offset in the tensor) for every chunk of `tensor`."""
    rows = rows_per_chunk(tensor.shape)
    first_dim = tensor.shape[0] if tensor.shape else 1
    row_bytes = tensor.nbytes // first_dim if first_dim else 0
    for chunk, start in enumerate(range(0, first_dim, rows)):
        yield chunk, start * row_bytes


def default_threads() -> int:
    return max(1, min(os.cpu_count() or 1, MAX_THREADS))


def write_shard(
    path: Path,
    tensors: list[OutputTensor],
    seed: int,
    progress: Progress | None = None,
    threads: int | None = None,
) -> None:
    """Write one safetensors file holding `tensors`, filled with seeded random values.

    Chunks are generated and written (positional writes) on `threads` worker threads, with at
    most two chunks queued beyond those being generated. An exception in any chunk,
    KeyboardInterrupt included, cancels the rest and is raised here.
    """
    threads = threads or default_threads()
    with (
        StreamingWriter(path, tensors, metadata={"format": "pt"}) as writer,
        ThreadPoolExecutor(threads, thread_name_prefix="synth") as pool,
    ):

        def job(tensor: OutputTensor, chunk: int, offset: int) -> int:
            data = random_chunk(tensor, seed, chunk)
            writer.write(tensor.name, offset, data)
            return data.numel() * data.element_size()

        pending: set[Future[int]] = set()
        try:
            for tensor in tensors:
                for chunk, offset in chunks_of(tensor):
                    if len(pending) >= threads + 2:
                        pending = _collect(pending, progress, FIRST_COMPLETED)
                    pending.add(pool.submit(job, tensor, chunk, offset))
            _collect(pending, progress, ALL_COMPLETED)
        except BaseException:
            for future in pending:
                future.cancel()
            raise


def _collect(pending: set[Future[int]], progress: Progress | None, when: str) -> set[Future[int]]:
    """Wait for some (or all) futures, report their bytes, re-raise their errors."""
    done, rest = wait(pending, return_when=when)
    for future in done:
        written = future.result()
        if progress is not None:
            progress(written)
    return rest
