"""Short chunks as decode rows: a step whose chunks are all a few tokens long (a speculative
verification: each request's last token and its drafts; a draft model catching up on the tokens a
verification kept) runs as a decode step of one row per token, replaying a decode graph.

Row i of a chunk starting at position s is the token at s + i with context s + i + 1 and the chunk's
block table: the step's KV write covers every row before attention reads, so each row attends to the
positions up to its own, as the chunk's causal attention would. Such a step skips the mixed graph's
host work (its work list, the eager logits tail) and runs the decode kernel, which is also what plain
decoding runs, so a verified row's logits are computed as a decode step's would be.

The cost is attention's reads: every row reads its whole context, where one query tile of the prefill
kernel reads it once for the chunk; and a decode graph of many rows runs GEMMs no faster than the
mixed graph's. Measured on an H200 (bench/verify_rows_bench.py, qwen3-0.6b synthetic ptpc-fp8, k = 4,
each step waited for, ms decode rows / mixed graph): 1 request at context 128 1.20 / 2.29, at 8192
3.06 / 9.04 (the prefill kernel reads a long context for 5 queries without splitting it); 8 requests
at 512 2.14 / 2.49, at 2048 5.41 / 4.29; 32 requests at 128 3.24 / 2.88. Hence the bounds: at most
MAX_ROWS rows, and at most `max_reads` context positions read by the rows of split chunks together
(DECODE_ROWS_READS: between 8 x 5 x 512 = 20K, faster, and 8 x 5 x 2048 = 82K, slower; one request
at 8192, 41K, was 3x faster).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qruntime.engine.step_chunk import StepChunk

MAX_ROWS_PER_CHUNK = 16  # longer chunks are prefill work: the mixed or piecewise graphs run them
MAX_ROWS = 64  # 160 rows (32 requests) were slower than the mixed graph even at context 128
DECODE_ROWS_READS = 48 * 1024  # the model runner's max_reads (see the module docstring)


@dataclass(frozen=True)
class DecodeRows:
    """The step as decode rows, and which rows' logits the caller wants (None: every row, in order)."""

    chunks: tuple[StepChunk, ...]
    keep: tuple[int, ...] | None


def decode_rows(
    chunks: Sequence[StepChunk], all_logits: bool | Sequence[bool], max_reads: int, max_rows: int = MAX_ROWS
) -> DecodeRows | None:
    """`chunks` as one-token rows, or None when they are not worth it: more than max_rows rows, a chunk
    longer than MAX_ROWS_PER_CHUNK or holding image rows, or the rows of chunks of several tokens
    reading more than `max_reads` context positions together.
    all_logits (False, or one bool per chunk; True is refused: a scoring pass's rows are whole prompts)
    says which chunks want every row's logits; the others want their last row's. `keep` lists the
    rows to return, in step order (ModelRunner.prepare's rows), or is None when that is every row."""
    if all_logits is True:
        return None
    every = [False] * len(chunks) if all_logits is False else list(all_logits)
    if len(every) != len(chunks):
        raise ValueError(f"all_logits has {len(every)} entries for {len(chunks)} chunks")
    if sum(c.num_tokens for c in chunks) > max_rows:
        return None
    rows: list[StepChunk] = []
    keep: list[int] = []
    reads = 0
    for chunk, wide in zip(chunks, every, strict=True):
        n = chunk.num_tokens
        if n > 1:
            reads += n * (chunk.start + n)
        if n > MAX_ROWS_PER_CHUNK or chunk.vision_rows or reads > max_reads:
            return None
        first = len(rows)
        if n == 1:
            rows.append(chunk)
        else:
            mrope = chunk.mrope
            for i, token in enumerate(chunk.token_ids):
                axes = None if mrope is None else ((mrope[0][i],), (mrope[1][i],), (mrope[2][i],))
                rows.append(StepChunk((token,), chunk.start + i, chunk.block_table, axes))
        keep.extend(range(first, len(rows)) if wide else (len(rows) - 1,))
    return DecodeRows(tuple(rows), None if len(keep) == len(rows) else tuple(keep))
