"""The host side of a mixed-graph step (mixed_graphs.py): its inputs written with numpy into host
buffers laid out as the graphs' static device buffers, then copied over in two calls.

Built the general way (ModelRunner.prepare's fresh tensors in two packed copies, then each copied
into its static buffer and the rest padded: about ten small device ops), a replayed step of a few
tokens cost 0.6-1.0 ms of host time against 0.06-0.11 ms for a decode replay (H200, a speculative
verification of 5 tokens, bench/spec_step_profile.py at 2394a71). As decode_inputs.py does for the
decode graphs, the step is written here in place and sent as it will be read.

Layout: `wide` int64 [4 or 6, size]: input_ids, positions (one row, or three for M-RoPE),
slot_mapping, logits_indices; `narrow` int32: context_lens [max_seqs], query_start_loc
[max_seqs + 1], the attention work list [work], block_tables [max_seqs, max_blocks] last, so that a
step copies the tables of its own sequences' rows and no more. Every input starts 16-byte aligned
(rows and regions padded to it): Triton specializes a pointer on that alignment, and a misaligned
view would launch kernel variants of their own, compiled mid-serving and not the ones prebuilt. Token rows past the step, up to its
bucket, hold the padding (token 0 at position 0, writing the scratch block); sequence rows past it
are empty (context 0, query_start_loc repeating the step's token count). A row's block table is
written up to its length: what a longer table left after it is never read (every kernel stops at
the sequence's context).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from qruntime.engine.step_chunk import StepChunk
from qruntime.engine.step_rows import logit_rows, mrope_rows

TOKEN_NAMES = ("input_ids", "positions", "slot_mapping")
ALIGN = 16  # bytes: where each input starts


def _aligned(count: int, itemsize: int) -> int:
    """count rounded up to a whole number of ALIGN bytes of `itemsize` items."""
    step = ALIGN // itemsize
    return -(-count // step) * step


@dataclass(frozen=True)
class MixedStep:
    """What `MixedInputs.fill` wrote: the step's token rows, the rows whose logits come back, and its
    sequences' query starts [B + 1] and context lengths [B] (for the attention work list)."""

    tokens: int
    logit_rows: int
    query_start: tuple[int, ...]
    context_lens: tuple[int, ...]
    max_q_len: int


class MixedInputs:
    """Host buffers for mixed steps of up to `size` tokens and `max_seqs` sequences of at most
    `max_blocks` KV blocks, with `work` int32 entries of attention work list."""

    def __init__(
        self,
        size: int,
        max_seqs: int,
        max_blocks: int,
        work: int,
        block_size: int,
        scratch_block: int,
        pin: bool,
        mrope: bool = False,
    ) -> None:
        self.size, self.max_seqs, self.max_blocks, self.work = size, max_seqs, max_blocks, work
        self.block_size, self.scratch_block, self.mrope = block_size, scratch_block, mrope
        # narrow's regions: context_lens, query_start_loc, work, then the tables, each at an aligned start
        self.starts = tuple(itertools.accumulate((_aligned(n, 4) for n in (max_seqs, max_seqs + 1, work)), initial=0))
        self.wide = torch.zeros(6 if mrope else 4, _aligned(size, 8), dtype=torch.int64, pin_memory=pin)
        self.narrow = torch.zeros(self.starts[-1] + max_seqs * max_blocks, dtype=torch.int32, pin_memory=pin)
        self.tensors = self.views(self.wide, self.narrow)
        self.tensors["block_tables"].fill_(scratch_block)
        self.tensors["slot_mapping"].fill_(scratch_block * block_size)
        self.arrays = {name: tensor.numpy() for name, tensor in self.tensors.items()}

    def views(self, wide: torch.Tensor, narrow: torch.Tensor) -> dict[str, torch.Tensor]:
        """The named inputs as views of a (wide, narrow) pair laid out as this one's (host or device)."""
        seqs, rows, size = self.max_seqs, 3 if self.mrope else 1, self.size
        lens, starts, work, tables = self.starts
        return {
            "input_ids": wide[0, :size],
            "positions": wide[1 : 1 + rows, :size] if self.mrope else wide[1, :size],
            "slot_mapping": wide[1 + rows, :size],
            "logits_indices": wide[2 + rows, :size],
            "context_lens": narrow[lens : lens + seqs],
            "query_start_loc": narrow[starts : starts + seqs + 1],
            "work": narrow[work : work + self.work],
            "block_tables": narrow[tables:].view(seqs, self.max_blocks),
        }

    def twin(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A (wide, narrow) pair on `device` holding this one's current values (the graphs' buffers)."""
        return self.wide.to(device), self.narrow.to(device)

    def spans(self, seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What a step of `seqs` sequences copies into the twin, two contiguous spans: all of `wide`
        (a few int64 rows of `size`), and `narrow` up to the end of its sequences' block tables."""
        return self.wide, self.narrow[: self.starts[-1] + seqs * self.max_blocks]

    def fill(self, chunks: Sequence[StepChunk], bucket: int, all_logits: bool | Sequence[bool] = False) -> MixedStep:
        """Write the step `chunks`, its token rows padded to `bucket`, into the host buffers (the work
        list is the caller's: it needs the step's query starts and context lengths, returned)."""
        count = len(chunks)
        lens = np.fromiter((c.num_tokens for c in chunks), np.int64, count)
        starts = np.zeros(count + 1, np.int64)
        np.cumsum(lens, out=starts[1:])
        tokens = int(starts[-1])
        widths = [len(c.block_table) for c in chunks]
        if not 0 < count <= self.max_seqs or not tokens <= bucket <= self.size or max(widths) > self.max_blocks:
            raise ValueError(
                f"a step of {count} sequences, {tokens} tokens and block tables of up to {max(widths, default=0)} "
                f"blocks does not fit bucket {bucket} ({self.max_seqs} sequences, {self.size} tokens, "
                f"{self.max_blocks} blocks at most)"
            )
        first = np.fromiter((c.start for c in chunks), np.int64, count)
        context = first + lens
        seq = np.repeat(np.arange(count), lens)  # the chunk of every token of the step
        positions = np.arange(tokens) - starts[seq] + first[seq]
        a, bs = self.arrays, self.block_size
        tables = a["block_tables"]
        for b, chunk in enumerate(chunks):
            tables[b, : widths[b]] = chunk.block_table
        a["input_ids"][:tokens] = np.fromiter(
            itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64, tokens
        )
        a["positions"][..., :tokens] = mrope_rows(chunks, positions, starts) if self.mrope else positions
        a["slot_mapping"][:tokens] = tables[seq, positions // bs].astype(np.int64) * bs + positions % bs
        a["input_ids"][tokens:bucket] = 0
        a["positions"][..., tokens:bucket] = 0
        a["slot_mapping"][tokens:bucket] = self.scratch_block * bs
        rows = logit_rows(all_logits, lens, starts, seq)
        a["logits_indices"][: len(rows)] = rows
        a["context_lens"][:count] = context
        a["context_lens"][count:] = 0
        a["query_start_loc"][: count + 1] = starts
        a["query_start_loc"][count + 1 :] = tokens
        return MixedStep(tokens, len(rows), tuple(starts.tolist()), tuple(context.tolist()), int(lens.max()))
