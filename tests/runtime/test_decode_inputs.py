"""DecodeInputs, the host side of a graph-replayed decode step: what it writes into its buffers equals
a batch built from scratch, step after step, whatever the rows held before (stale block-table
entries of a longer table, rows that were sequences and are now padding)."""

from __future__ import annotations

import random

import pytest
import torch
from qruntime.engine.decode_inputs import DecodeInputs
from qruntime.engine.step_chunk import StepChunk

BLOCK, MAX_BLOCKS, SCRATCH = 4, 9, 99


def reference(chunks: list[StepChunk], bucket: int) -> dict[str, torch.Tensor]:
    """The padded batch as the graphs must see it, built from nothing."""
    tables = torch.full((bucket, MAX_BLOCKS), SCRATCH, dtype=torch.int32)
    ids, positions, slots, lens = [0] * bucket, [0] * bucket, [SCRATCH * BLOCK] * bucket, [1] * bucket
    for b, c in enumerate(chunks):
        ids[b], positions[b], lens[b] = c.token_ids[0], c.start, c.start + 1
        slots[b] = c.block_table[c.start // BLOCK] * BLOCK + c.start % BLOCK
        tables[b, : len(c.block_table)] = torch.tensor(c.block_table, dtype=torch.int32)
    return {
        "input_ids": torch.tensor(ids),
        "positions": torch.tensor(positions),
        "slot_mapping": torch.tensor(slots),
        "context_lens": torch.tensor(lens, dtype=torch.int32),
        "block_tables": tables,
    }


def random_chunk(rng: random.Random) -> StepChunk:
    pos = rng.randrange(MAX_BLOCKS * BLOCK)
    blocks = rng.randint(pos // BLOCK + 1, MAX_BLOCKS)  # a table may hold blocks past the position
    return StepChunk((rng.randrange(1, 1000),), pos, tuple(rng.sample(range(SCRATCH), blocks)))


def test_every_step_equals_a_batch_built_from_scratch():
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    inputs = DecodeInputs(16, MAX_BLOCKS, BLOCK, SCRATCH, pin=False)
    for _ in range(60):  # batches grow and shrink: rows go from long tables to short ones to padding
        batch = rng.randint(1, 16)
        bucket = rng.choice([b for b in (1, 2, 4, 8, 16) if b >= batch])
        chunks = [random_chunk(rng) for _ in range(batch)]
        inputs.fill(chunks, bucket)
        got, want = {name: t[:bucket] for name, t in inputs.tensors.items()}, reference(chunks, bucket)
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    # rows past the last bucket used keep only scratch too (the next, larger bucket reads them)
    inputs.fill([], 16)
    assert torch.equal(inputs.tensors["block_tables"], torch.full((16, MAX_BLOCKS), SCRATCH, dtype=torch.int32))


@pytest.mark.parametrize(
    "chunk",
    [
        StepChunk((1, 2), 4, (0, 1)),  # two tokens: a prefill chunk, not a decode row
        StepChunk((1,), 8, (0, 1)),  # position 8 lies past the table's two blocks of 4
        StepChunk((1,), 0, tuple(range(MAX_BLOCKS + 1))),  # more blocks than the graphs' tables hold
    ],
)
def test_a_row_the_graphs_cannot_run_is_refused(chunk):
    with pytest.raises(ValueError, match="row 0"):
        DecodeInputs(4, MAX_BLOCKS, BLOCK, SCRATCH, pin=False).fill([chunk], 1)


def test_a_batch_larger_than_its_bucket_is_refused():
    chunks = [StepChunk((1,), 0, (0,))] * 3
    with pytest.raises(ValueError, match="bucket 2"):
        DecodeInputs(4, MAX_BLOCKS, BLOCK, SCRATCH, pin=False).fill(chunks, 2)


def test_the_two_span_copies_carry_every_input_the_graphs_read():
    """What DecodeGraphs does on the GPU, on CPU: after each fill, copy the two spans into the twin;
    the twin's views of the first `bucket` rows then equal a batch built from scratch."""
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    inputs = DecodeInputs(16, MAX_BLOCKS, BLOCK, SCRATCH, pin=False)
    wide, narrow = inputs.twin(torch.device("cpu"))
    twin = inputs.views(wide, narrow)
    for _ in range(40):
        batch = rng.randint(1, 16)
        bucket = rng.choice([b for b in (1, 2, 4, 8, 16) if b >= batch])
        chunks = [random_chunk(rng) for _ in range(batch)]
        inputs.fill(chunks, bucket)
        host_wide, host_narrow = inputs.spans(bucket)
        assert host_narrow.numel() == 16 + bucket * MAX_BLOCKS  # every length, `bucket` tables: no more
        wide.copy_(host_wide)
        narrow[: host_narrow.numel()].copy_(host_narrow)
        for name, want in reference(chunks, bucket).items():
            assert torch.equal(twin[name][:bucket], want), name
