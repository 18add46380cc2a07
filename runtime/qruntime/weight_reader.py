"""Weight files to device memory at disk and PCIe speed: large reads into pinned buffers, several in
flight, each copied to the device while the next are read.

Copying each weight from a memory-mapped file (`tensor.to("cuda")` on a view of the mapping) reads
the file one page fault at a time and stages every copy through the driver's own bounce buffer: an
H200 loaded qwen3-8b's 8.8 GB at 1.2 GB/s from a cold page cache and 5 GB/s from a warm one. Here
`read_extents` merges the tensors' byte ranges into file-ordered spans, cuts them into chunks of
CHUNK_BYTES, and has READERS threads `preadv` chunks straight into a ring of pinned host buffers
(the system call releases the GIL, so reads run in parallel and beside the copies); the calling
thread issues each chunk's pieces as asynchronous host-to-device copies on a side stream and hands
a buffer back to the readers once its copies are done (a CUDA event). Every destination is a tensor
of its own, so the weights keep the alignment of separate allocations that the kernels were tuned
and recorded with. The host holds only the ring, never a whole file (torch's pinned-memory cache
keeps the ring's 256 MiB for the process's later pinned allocations).

On a CPU device the same pipeline runs with plain buffers and synchronous copies (how the tests
check it); the engine's CPU path maps the files instead (weights.py: no copy at all).
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from qruntime.artifact import ArtifactFormatError

CHUNK_BYTES = 32 << 20  # one read, one pinned buffer
READERS = 8  # reads in flight: a cold disk serves several faster than one, a warm page cache scales with them
BUFFERS = 16  # pinned buffers in the ring (512 MiB of host memory at the defaults)
GAP_BYTES = 1 << 20  # ranges this close are read as one span (the bytes between are read and dropped)


@dataclass(frozen=True)
class Extent:
    key: Hashable  # names the destination tensor
    path: Path
    offset: int
    length: int


@dataclass(frozen=True)
class Chunk:
    path: Path
    offset: int
    length: int
    pieces: tuple[tuple[Hashable, int, int, int], ...]  # (key, offset in the tensor, offset in the chunk, bytes)


def plan_chunks(extents: Sequence[Extent], chunk_bytes: int = CHUNK_BYTES, gap: int = GAP_BYTES) -> list[Chunk]:
    """The reads that cover every extent: per file, in offset order, neighbouring extents merged
    across gaps up to `gap` bytes, cut at `chunk_bytes`; each chunk lists the extents' pieces it holds."""
    chunks: list[Chunk] = []
    by_file: dict[Path, list[Extent]] = {}
    for extent in extents:
        if extent.length > 0:
            by_file.setdefault(extent.path, []).append(extent)
    for path, items in by_file.items():
        items.sort(key=lambda e: e.offset)
        spans: list[list[Extent]] = []
        for extent in items:
            if spans and extent.offset <= max(e.offset + e.length for e in spans[-1]) + gap:
                spans[-1].append(extent)
            else:
                spans.append([extent])
        for span in spans:
            start, end = span[0].offset, max(e.offset + e.length for e in span)
            for at in range(start, end, chunk_bytes):
                stop = min(at + chunk_bytes, end)
                pieces = tuple(
                    (
                        e.key,
                        max(at, e.offset) - e.offset,
                        max(at, e.offset) - at,
                        min(stop, e.offset + e.length) - max(at, e.offset),
                    )
                    for e in span
                    if e.offset < stop and e.offset + e.length > at
                )
                if pieces:
                    chunks.append(Chunk(path, at, stop - at, pieces))
    return chunks


def _read_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:  # the file's size, not this read's offset: readers past the end report the same byte
            raise ArtifactFormatError(
                f"{path}: ended at byte {os.fstat(fd).st_size}, before {offset + len(view)} (truncated while loading?)"
            )
        done += n


def read_extents(
    extents: Sequence[Extent],
    destinations: Mapping[Hashable, torch.Tensor],
    *,
    chunk_bytes: int = CHUNK_BYTES,
    readers: int = READERS,
    buffers: int = BUFFERS,
) -> int:
    """Fill each destination (a contiguous tensor on one device, its byte size the extent's length)
    with its extent's bytes; returns the bytes read. Raises ArtifactFormatError for a file that ends
    early, OSError for one that cannot be read, after every reader has stopped."""
    for extent in extents:
        dst = destinations[extent.key]
        if not dst.is_contiguous() or dst.numel() * dst.element_size() != extent.length:
            raise ValueError(f"{extent.key}: the destination does not hold {extent.length} contiguous bytes")
    chunks = plan_chunks(extents, chunk_bytes)
    if not chunks:
        return 0
    device = next(iter(destinations.values())).device
    flat = {key: t.view(-1).view(torch.uint8) for key, t in destinations.items()}
    cuda = device.type == "cuda"
    size = max(c.length for c in chunks)
    ring = [torch.empty(size, dtype=torch.uint8, pin_memory=cuda) for _ in range(min(buffers, len(chunks)))]
    free: queue.Queue[int] = queue.Queue()
    for slot in range(len(ring)):
        free.put(slot)
    ready: queue.Queue[tuple[int, int] | BaseException] = queue.Queue()
    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(chunks)):
        todo.put(i)
    stop = threading.Event()
    fds: dict[Path, int] = {}
    fd_lock = threading.Lock()

    def fd_of(path: Path) -> int:
        with fd_lock:
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY)
            return fds[path]

    def reader() -> None:
        while not stop.is_set():
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            slot = free.get()
            if stop.is_set():
                return
            chunk = chunks[index]
            try:
                _read_into(fd_of(chunk.path), memoryview(ring[slot].numpy())[: chunk.length], chunk.offset, chunk.path)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which stops the others
                ready.put(exc)
                return
            ready.put((index, slot))

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(max(1, min(readers, len(chunks))))]
    stream = torch.cuda.Stream(device) if cuda else None
    in_flight: deque[tuple[torch.cuda.Event, int]] = deque()
    total = 0
    try:
        for thread in threads:
            thread.start()
        for _ in range(len(chunks)):
            item = ready.get()
            if isinstance(item, BaseException):
                raise item
            index, slot = item
            chunk = chunks[index]
            buf = ring[slot]
            if stream is None:
                for key, at, start, n in chunk.pieces:
                    flat[key][at : at + n].copy_(buf[start : start + n])
                free.put(slot)
            else:
                with torch.cuda.stream(stream):
                    for key, at, start, n in chunk.pieces:
                        flat[key][at : at + n].copy_(buf[start : start + n], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                in_flight.append((event, slot))
                while in_flight and (in_flight[0][0].query() or free.empty()):
                    event, done_slot = in_flight.popleft()
                    event.synchronize()
                    free.put(done_slot)
            total += sum(n for *_, n in chunk.pieces)
        if stream is not None:
            stream.synchronize()
            torch.cuda.current_stream(device).wait_stream(stream)
    finally:
        if stream is not None:  # no copy may still read a buffer when the ring is freed
            stream.synchronize()
        stop.set()
        for _ in threads:  # wake readers waiting for a buffer
            free.put(0)
        for thread in threads:
            thread.join()
        for fd in fds.values():
            os.close(fd)
    return total
