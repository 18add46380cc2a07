"""Short chunks as decode rows: a step whose chunks are all a few tokens long (a speculative
verification: each request's last token and its drafts; a draft model catching up on the tokens a
verification kept) runs as a decode step of one row per token, replaying a decode graph.

Row i of a chunk starting at position s is the token at s + i with context s + i + 1 and the chunk's
block table: the step's KV write covers every row before attention reads, so each row attends to the
positions up to its own, as the chunk's causal attention would. Such a step skips the mixed graph's
host work (its work list, the eager logits tail) and runs the decode kernel, which is also what plain
decoding runs, so a verified row's logits are computed as a decode step's would be.

The cost is attention's reads: every row reads its whole context, where one query tile of the prefill
kernel reads it once for the chunk. `max_context` bounds the contexts of the chunks split this way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qruntime.engine.step_chunk import StepChunk

MAX_ROWS_PER_CHUNK = 16  # longer chunks are prefill work: the mixed or piecewise graphs run them
DECODE_ROWS_CONTEXT = 2048  # the model runner's max_context


@dataclass(frozen=True)
class DecodeRows:
    """The step as decode rows, and which rows' logits the caller wants (None: every row, in order)."""

    chunks: tuple[StepChunk, ...]
    keep: tuple[int, ...] | None


def decode_rows(chunks: Sequence[StepChunk], all_logits: bool | Sequence[bool], max_context: int) -> DecodeRows | None:
    """`chunks` as one-token rows, or None when some chunk cannot be split: longer than
    MAX_ROWS_PER_CHUNK, ending past `max_context` with more than one token, or holding image rows.
    all_logits (False, or one bool per chunk; True is refused: a scoring pass's rows are whole prompts)
    says which chunks want every row's logits; the others want their last row's. `keep` lists the
    rows to return, in step order (ModelRunner.prepare's rows), or is None when that is every row."""
    if all_logits is True:
        return None
    every = [False] * len(chunks) if all_logits is False else list(all_logits)
    if len(every) != len(chunks):
        raise ValueError(f"all_logits has {len(every)} entries for {len(chunks)} chunks")
    rows: list[StepChunk] = []
    keep: list[int] = []
    for chunk, wide in zip(chunks, every, strict=True):
        n = chunk.num_tokens
        if n > MAX_ROWS_PER_CHUNK or chunk.vision_rows or (n > 1 and chunk.start + n > max_context):
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
