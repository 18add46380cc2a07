"""Execute a TensorPlan: stream row chunks from the checkpoint, quantize or copy, write in place.

Each work item is one row chunk of one source tensor: read with a pread, checked for NaN/Inf,
quantized (per-channel scales are per row, block scales per 128-row band, so chunks aligned to
the scheme's `row_align` give exactly the bytes of quantizing the whole tensor at once), and
written with pwrites at the offsets of the fused tensor. A small thread pool keeps both cores
busy (torch and file I/O release the GIL); at most a few chunks are in flight, which bounds memory
whatever the model's size.

A linear the checkpoint stores quantized (a pre-quantized input: qcompile.source.stored) is not
quantized again: its chunk's stored weight rows and their scales are read (and checked) and written
as they are, which is what quantizing the bf16 original gives, byte for byte.

A per-tensor scheme's scale depends on the whole source tensor, so before the first chunk of such
a source is quantized, a pre-pass reads the source in row chunks of the same size for its amax
(the pool again, NaN/Inf checked there); its chunks are then quantized with that amax and come out
byte-identical to quantizing the whole tensor at once. The pre-pass runs just before the source's
chunks, which then mostly come from the page cache.

At tp > 1 each chunk is still read and quantized once: its rows (or columns) are then written to
every rank whose slice holds them (qcompile.compile.sharding), so every rank's tensor is the exact slice of
the tp=1 tensor, scales included, and the source is read once whatever the number of ranks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from qcompile.compile.awq_scales import AwqScales
from qcompile.compile.jobs import WeightJob
from qcompile.compile.plan import TensorPlan
from qcompile.compile.sharding import Split
from qcompile.errors import TensorValueError
from qcompile.io.safetensors_stream import StreamingWriter
from qcompile.quant.fp8 import amax_abs, tensor_amax
from qcompile.source.checkpoint import Checkpoint

CHUNK_BYTES = 8 << 20
IN_FLIGHT_BYTES = 128 << 20  # source bytes in flight across all workers: bounds memory on many-core hosts


def chunk_size(workers: int, limit: int = CHUNK_BYTES) -> int:
    """Bytes per chunk so that the 2 x workers chunks in flight stay within IN_FLIGHT_BYTES."""
    return max(1 << 20, min(limit, IN_FLIGHT_BYTES // (2 * workers)))


@dataclass(frozen=True)
class ChunkTask:
    job: WeightJob
    slice_index: int  # index along the stack axis (0 when not stacked)
    source: str
    dest_row: int  # first row of the fused tensor this source part starts at
    start: int  # row range [start, stop) within the source
    stop: int


def row_ranges(rows: int, row_bytes: int, chunk_bytes: int, align: int = 1) -> Iterator[tuple[int, int]]:
    """[start, stop) row ranges of about `chunk_bytes` each, every start a multiple of `align`."""
    step = max(align, (chunk_bytes // max(row_bytes, 1)) // align * align)
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def iter_tasks(plan: TensorPlan, chunk_bytes: int = CHUNK_BYTES) -> Iterator[ChunkTask]:
    for job in plan.jobs:
        align = job.quant.row_align
        for s, parts in enumerate(job.part_rows(plan.source_shapes)):
            for source, begin, end in parts:
                shape = plan.source_shapes[source]
                rows = end - begin
                if len(shape) == 1:
                    yield ChunkTask(job, s, source, begin, 0, rows)
                    continue
                row_bytes = plan.model_dtype.itemsize * shape[1]
                for start, stop in row_ranges(rows, row_bytes, chunk_bytes, align):
                    yield ChunkTask(job, s, source, begin, start, stop)


class _Writers:
    """One StreamingWriter per output shard, looked up by (rank, tensor name)."""

    def __init__(self, root: Path, plan: TensorPlan) -> None:
        self.by_tensor: dict[tuple[int, str], StreamingWriter] = {}
        self.files: list[StreamingWriter] = []
        try:
            for shard in plan.shards:
                (root / shard.file).parent.mkdir(parents=True, exist_ok=True)
                writer = StreamingWriter(
                    root / shard.file, list(shard.tensors), metadata={"format": "pt"}, hash_while_writing=True
                )
                self.files.append(writer)
                for tensor in shard.tensors:
                    self.by_tensor[(shard.rank, tensor.name)] = writer
        except BaseException:
            self.abort()  # stop the hashers of the files already opened
            raise

    def digests(self, root: Path) -> dict[str, str]:
        """relative path -> sha256 of every shard (waits for the hashers to finish)."""
        return {w.path.relative_to(root).as_posix(): w.sha256() for w in self.files}

    def abort(self) -> None:
        for writer in self.files:
            writer.abort()


def _run_task(
    task: ChunkTask,
    checkpoint: Checkpoint,
    plan: TensorPlan,
    writers: _Writers,
    amax: torch.Tensor | None = None,
    transform: AwqScales | None = None,
) -> int:
    """Quantize (or copy) and write one chunk; `amax` is its whole source's, for per-tensor schemes;
    `transform` (AWQ's scales) changes the source's rows before they are quantized."""
    job = task.job
    weight_shape = job.weight_shape(plan.source_shapes)
    fused_rows = weight_shape[1] if job.stacked else weight_shape[0]
    stored = checkpoint.stored.get(task.source)
    zero_point = None
    if stored is not None:  # already quantized: copied, its scales checked
        q, scale, zero_point = stored.read_rows(task.start, task.stop)
        row_bytes = stored.row_bytes
    else:
        entry = checkpoint.entry(task.source)
        chunk = entry.read_rows(task.start, task.stop)
        if transform is not None:
            chunk = transform.apply(task.source, task.start, task.stop, chunk)
        q, scale = _quantize_chunk(job, task, chunk, amax)
        row_bytes = entry.row_bytes
    row = task.dest_row + task.start
    _write_rows(writers, plan, job.weight_name, job.stacked, task.slice_index, fused_rows, row, q)
    if scale is not None:
        assert job.scale_name is not None
        align = job.quant.row_align
        scale_rows_total = -(-fused_rows // align)
        _write_rows(writers, plan, job.scale_name, job.stacked, task.slice_index, scale_rows_total, row // align, scale)
    if job.zero_point_name is not None:  # one per scale (w4a16-zp: read from the checkpoint, row_align 1)
        assert zero_point is not None
        _write_rows(writers, plan, job.zero_point_name, job.stacked, task.slice_index, fused_rows, row, zero_point)
    return row_bytes * (task.stop - task.start)


def _quantize_chunk(
    job: WeightJob, task: ChunkTask, chunk: torch.Tensor, amax: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, scale or None) of a chunk read from the source in the model dtype, NaN/Inf refused."""
    if job.quant.quantized:
        if job.quant.per_tensor and amax is None:
            raise ValueError(f"{task.source}: a per-tensor scheme's chunk needs its source's amax")
        q, scale = job.quant.quantize(chunk, amax)
        # amax over each row or block propagates NaN and Inf into the scale: one cheap check
        if not bool(torch.isfinite(scale).all()):
            _raise_nonfinite(task.source, task.start, chunk)
        return q, scale
    if chunk.numel() and not bool(torch.isfinite(amax_abs(chunk, tuple(range(chunk.dim())))).all()):
        _raise_nonfinite(task.source, task.start, chunk)  # the amax carries any NaN or Inf: a one-pass check
    return chunk, None


def _write_rows(
    writers: _Writers,
    plan: TensorPlan,
    name: str,
    stacked: bool,
    slice_index: int,
    rows_total: int,
    row: int,
    data: torch.Tensor,
) -> None:
    """Write `data`, rows [row, row + len(data)) of slice `slice_index` (of `rows_total` rows) of the
    whole tensor `name`, into every rank's copy: all of it, or the rows or columns its slice keeps."""
    split = plan.splits.get(name) or Split(plan.tp)
    if split.axis is None:
        row_bytes = data[0].numel() * data.element_size() if data.dim() > 1 else data.element_size()
        for rank in plan.holders(name):  # every rank, or rank 0 alone (the vision tower at tp > 1)
            writers.by_tensor[(rank, name)].write(name, (slice_index * rows_total + row) * row_bytes, data)
        return
    by_rows = split.axis == int(stacked)  # else the split is along the columns
    row_bytes = data[0].numel() * data.element_size()
    for rank, spans in enumerate(split.ranks):
        writer = writers.by_tensor[(rank, name)]
        if not by_rows:
            piece = torch.cat([data[:, b:e] for b, e in spans], 1)  # [rows, the rank's columns]
            writer.write(name, (slice_index * rows_total + row) * piece[0].numel() * piece.element_size(), piece)
            continue
        local_rows = sum(e - b for b, e in spans)
        local = 0  # where the span starts in the rank's slice
        for begin, end in spans:
            lo, hi = max(begin, row), min(end, row + data.shape[0])
            if lo < hi:
                writer.write(
                    name, (slice_index * local_rows + local + lo - begin) * row_bytes, data[lo - row : hi - row]
                )
            local += end - begin


def _chunk_amax(checkpoint: Checkpoint, source: str, start: int, stop: int) -> torch.Tensor:
    """The pre-pass of per-tensor schemes: amax(|rows start..stop|) of `source`, [1], NaN/Inf refused."""
    chunk = checkpoint.entry(source).read_rows(start, stop)
    amax = tensor_amax(chunk)
    if not bool(torch.isfinite(amax).all()):
        _raise_nonfinite(source, start, chunk)
    return amax


def _raise_nonfinite(source: str, start: int, chunk: torch.Tensor) -> None:
    """TensorValueError naming `source` and its first NaN/Inf; `chunk` holds its rows from `start`."""
    bad = (~torch.isfinite(chunk.float())).nonzero()
    where = ""
    if len(bad):
        index = [int(i) for i in bad[0]]
        if chunk.dim() >= 1:
            index[0] += start
        value = chunk[tuple(int(i) for i in bad[0])].item()
        where = f" (first at index {index}: {value})"
    raise TensorValueError(
        f"source tensor {source!r} holds NaN or Inf values{where}; fix the checkpoint before compiling"
    )


def write_weights(
    root: Path,
    checkpoint: Checkpoint,
    plan: TensorPlan,
    workers: int = 2,
    progress: Callable[[int], None] | None = None,
    chunk_bytes: int | None = None,
    transform: AwqScales | None = None,
) -> dict[str, str]:
    """Write every shard of `plan` under `root` (the temporary artifact dir); `transform` (AWQ's
    scales) is applied to each source chunk as it is read (never to a per-tensor scheme's).

    Returns {relative path: sha256} of the shards, hashed while they were written.
    """
    writers = _Writers(root, plan)
    stop = threading.Event()
    chunk_bytes = chunk_bytes or chunk_size(workers)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # parallel over chunks, not inside each op: no oversubscription
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="qcompile-write") as pool:
            pending: set[Future[int]] = set()
            amaxes: dict[str, torch.Tensor] = {}  # source -> its amax, for per-tensor schemes

            def source_amax(source: str) -> torch.Tensor:
                """The whole source's amax from its row chunks, read on the pool (at most `workers` at once)."""
                entry = checkpoint.entry(source)
                ranges = row_ranges(entry.shape[0], entry.row_bytes, chunk_bytes)
                parts = [pool.submit(_guarded_amax, stop, checkpoint, source, a, b) for a, b in ranges]
                return torch.cat([part.result() for part in parts]).amax().reshape(1)

            def drain(limit: int) -> None:
                nonlocal pending
                while len(pending) > limit:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        nbytes = future.result()  # re-raises a worker's error here
                        if progress is not None:
                            progress(nbytes)

            try:
                for task in iter_tasks(plan, chunk_bytes):
                    amax = None
                    if task.job.quant.per_tensor and task.source not in checkpoint.stored:
                        if task.source not in amaxes:
                            amaxes[task.source] = source_amax(task.source)
                        amax = amaxes[task.source]
                    pending.add(pool.submit(_guarded, stop, task, checkpoint, plan, writers, amax, transform))
                    drain(2 * workers)
                drain(0)
            except BaseException:
                stop.set()  # queued chunks return at once; the error propagates
                raise
        for writer in writers.files:
            writer.close()
        return writers.digests(root)
    except BaseException:
        writers.abort()
        raise
    finally:
        torch.set_num_threads(threads)


def _guarded(
    stop: threading.Event,
    task: ChunkTask,
    checkpoint: Checkpoint,
    plan: TensorPlan,
    writers: _Writers,
    amax: torch.Tensor | None,
    transform: AwqScales | None = None,
) -> int:
    if stop.is_set():
        return 0
    return _run_task(task, checkpoint, plan, writers, amax, transform)


def _guarded_amax(
    stop: threading.Event, checkpoint: Checkpoint, source: str, start: int, stop_row: int
) -> torch.Tensor:
    if stop.is_set():
        raise RuntimeError("the write was stopped")  # never read: the error that stopped it propagates
    return _chunk_amax(checkpoint, source, start, stop_row)


SPARSE_DIGEST = "synthetic: sparse file, not hashed"


def write_sparse_weights(root: Path, plan: TensorPlan) -> dict[str, str]:
    """A synthetic artifact's weight files: every shard of `plan` with its real header and its data
    left as a hole (all zero, no disk). Returns {relative path: SPARSE_DIGEST}: nothing was hashed."""
    digests = {}
    for shard in plan.shards:
        (root / shard.file).parent.mkdir(parents=True, exist_ok=True)
        StreamingWriter(root / shard.file, list(shard.tensors), metadata={"format": "pt"}).close()
        digests[shard.file] = SPARSE_DIGEST
    return digests
