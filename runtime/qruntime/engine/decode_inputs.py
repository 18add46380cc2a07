"""The host side of a graph-replayed decode step: its inputs written in place into fixed host buffers.

The captured graphs read static device buffers; each step the host writes the batch's token ids,
positions, KV slots, context lengths and block tables into host buffers of the same layout (pinned
on CUDA, so the copies are asynchronous) and copies them over in two calls (each torch call gives
up the GIL, and a served step's other thread may then hold it for milliseconds). Writing goes through numpy views of
those buffers, one row per sequence: a torch op per row costs ~10-20 us of dispatch, which at 128
sequences was half of a served decode step. A row's block table is written only up to its length;
the entries a longer table left behind in that row are reset to the scratch block, so every row
reads exactly its own blocks and then scratch, as the padding rows do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from qruntime.engine.step_chunk import StepChunk

NAMES = ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables")


class DecodeInputs:
    """Host buffers for decode batches of up to `size` sequences of at most `max_blocks` KV blocks."""

    def __init__(
        self, size: int, max_blocks: int, block_size: int, scratch_block: int, pin: bool, mrope: bool = False
    ) -> None:
        self.size, self.max_blocks = size, max_blocks
        self.block_size, self.scratch_block = block_size, scratch_block
        self.mrope = mrope  # Qwen3-VL: positions [3, size] (M-RoPE), a row per axis
        # two spans, each copied in one call: the int64 rows, and the int32 lengths followed by the tables
        self.wide = torch.zeros(5 if mrope else 3, size, dtype=torch.int64, pin_memory=pin)
        self.narrow = torch.full((size * (1 + max_blocks),), scratch_block, dtype=torch.int32, pin_memory=pin)
        self.tensors = self.views(self.wide, self.narrow)
        self.tensors["slot_mapping"].fill_(scratch_block * block_size)
        self.tensors["context_lens"].fill_(1)
        self._ids, self._positions, self._slots, self._lens, self._tables = (self.tensors[n].numpy() for n in NAMES)
        self._row_len = [0] * size  # block-table entries written in each row (the rest is scratch)

    def views(self, wide: torch.Tensor, narrow: torch.Tensor) -> dict[str, torch.Tensor]:
        """The named inputs as views of a (wide, narrow) pair laid out as this one's (host or device)."""
        size = self.size
        return {
            "input_ids": wide[0],
            "positions": wide[1:4] if self.mrope else wide[1],
            "slot_mapping": wide[-1],
            "context_lens": narrow[:size],
            "block_tables": narrow[size:].view(size, self.max_blocks),
        }

    def twin(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A (wide, narrow) pair on `device` holding this one's current values (the graphs' buffers)."""
        return self.wide.to(device), self.narrow.to(device)

    def spans(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What a step of `bucket` rows must copy into the twin: all of `wide` (3 or 5 x size int64) and
        the front of `narrow` (every length, the first `bucket` tables): two contiguous copies."""
        return self.wide, self.narrow[: self.size + bucket * self.max_blocks]

    def fill(self, chunks: Sequence[StepChunk], bucket: int) -> None:
        """Write the decode batch `chunks` (one token each) padded to `bucket` rows into the host
        buffers (`tensors`). Padding rows write the scratch block and read only it."""
        if not len(chunks) <= bucket <= self.size:
            raise ValueError(f"a batch of {len(chunks)} sequences does not fit bucket {bucket} (at most {self.size})")
        bs, scratch, row_len = self.block_size, self.scratch_block, self._row_len
        ids, positions, slots, lens, tables = self._ids, self._positions, self._slots, self._lens, self._tables
        for b, chunk in enumerate(chunks):
            pos, table = chunk.start, chunk.block_table
            n = len(table)
            if chunk.num_tokens != 1 or not pos < n * bs <= self.max_blocks * bs:
                raise ValueError(
                    f"row {b}: a decode row computes one token inside its block table "
                    f"(got {chunk.num_tokens} tokens at position {pos}, {n} blocks, at most {self.max_blocks})"
                )
            ids[b] = chunk.token_ids[0]
            positions[..., b] = pos if chunk.mrope is None else [axis[0] for axis in chunk.mrope]
            slots[b] = table[pos // bs] * bs + pos % bs
            lens[b] = pos + 1
            tables[b, :n] = table
            if row_len[b] > n:
                tables[b, n : row_len[b]] = scratch
            row_len[b] = n
        for b in range(len(chunks), bucket):
            ids[b] = positions[..., b] = 0
            slots[b] = scratch * bs
            lens[b] = 1
            if row_len[b]:
                tables[b, : row_len[b]] = scratch
                row_len[b] = 0
