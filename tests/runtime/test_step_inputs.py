"""A step's inputs as the model runner builds them (numpy, packed, TableSlots) against the definitions:
each chunk's ids and positions laid end to end, slot = block_table[pos // bs] * bs + pos % bs, the
last token of each chunk for the logits; and transfer.pack's layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from qruntime.engine.model_runner import ModelRunner
from qruntime.engine.step_chunk import StepChunk
from qruntime.engine.transfer import ALIGN_BYTES, pack
from qruntime.ops.base import TableSlots


class _Spec:
    block_size = 4


class _Cache:
    spec = _Spec()


def _random_chunks(rng, count: int) -> list[StepChunk]:
    chunks = []
    for _ in range(count):
        start = rng.randrange(0, 40)
        n = 1 if rng.random() < 0.5 else rng.randrange(1, 12)
        blocks = -(-(start + n) // 4) + rng.randrange(0, 3)  # tables may run past the last position
        chunks.append(
            StepChunk(tuple(rng.randrange(-3, 500) for _ in range(n)), start, tuple(rng.sample(range(200), blocks)))
        )
    return chunks


@pytest.mark.parametrize("all_logits", [False, True, "per chunk"])
def test_prepare_lays_out_each_chunk_as_defined(rng, all_logits):
    runner = ModelRunner(plan=None, kv_cache=_Cache(), device=torch.device("cpu"), max_context_len=64)
    chunks = _random_chunks(rng, rng.randrange(1, 9))
    if all_logits == "per chunk":
        all_logits = tuple(rng.random() < 0.5 for _ in chunks)
    feeds, meta = runner.prepare(chunks, all_logits=all_logits)
    ids, positions, slots, starts, lens = [], [], [], [0], []
    for c in chunks:
        ids += c.token_ids
        positions += range(c.start, c.start + c.num_tokens)
        slots += [c.block_table[p // 4] * 4 + p % 4 for p in range(c.start, c.start + c.num_tokens)]
        starts.append(starts[-1] + c.num_tokens)
        lens.append(c.start + c.num_tokens)
    assert feeds["input_ids"].tolist() == ids and feeds["input_ids"].dtype == torch.int64
    assert feeds["positions"].tolist() == positions
    assert feeds["slot_mapping"].tolist() == slots
    assert feeds["query_start_loc"].tolist() == starts and feeds["query_start_loc"].dtype == torch.int32
    assert feeds["context_lens"].tolist() == lens and feeds["context_lens"].dtype == torch.int32
    every = [all_logits] * len(chunks) if isinstance(all_logits, bool) else all_logits
    rows = [r for b, e in enumerate(every) for r in (range(starts[b], starts[b + 1]) if e else [starts[b + 1] - 1])]
    assert feeds["logits_indices"].tolist() == rows
    width = max(len(c.block_table) for c in chunks)
    assert feeds["block_tables"].tolist() == [list(c.block_table) + [0] * (width - len(c.block_table)) for c in chunks]
    assert meta.query_start == tuple(starts) and meta.context_lens == tuple(lens)
    assert meta.max_q_len == max(c.num_tokens for c in chunks) and meta.max_context_len == 64
    for b, c in enumerate(chunks):
        want = [c.block_table[p // 4] * 4 + p % 4 for p in range(lens[b])]
        assert meta.cache_slots[b].tolist() == want
    assert [t.tolist() for t in meta.cache_slots[1:]] == [
        t.tolist() for t in (meta.cache_slots[b] for b in range(1, len(chunks)))
    ]


def test_pack_aligns_every_array_and_keeps_its_values(rng):
    arrays = {
        f"a{i}": np.array([rng.randrange(-(1 << 40), 1 << 40) for _ in range(rng.randrange(0, 7))], np.int64)
        for i in range(4)
    }
    arrays["table"] = np.array([[rng.randrange(1 << 20) for _ in range(3)] for _ in range(5)], np.int64)
    packed = pack(arrays, torch.device("cpu"))
    base = packed["a0"].data_ptr() - packed["a0"].storage_offset() * 8
    for name, array in arrays.items():
        t = packed[name]
        assert t.tolist() == array.tolist() and t.shape == array.shape and t.is_contiguous()
        assert (t.data_ptr() - base) % ALIGN_BYTES == 0, name
    narrow = pack({"x": np.arange(3, dtype=np.int32), "y": np.arange(5, dtype=np.int32)}, torch.device("cpu"))
    assert (narrow["y"].data_ptr() - narrow["x"].data_ptr()) % ALIGN_BYTES == 0 and narrow["y"].tolist() == list(
        range(5)
    )
    with pytest.raises(ValueError, match="one dtype"):
        pack({"x": np.zeros(2, np.int32), "y": np.zeros(2, np.int64)}, torch.device("cpu"))


def test_table_slots_follow_the_block_tables(rng):
    tables = torch.tensor([rng.sample(range(100), 5) for _ in range(3)], dtype=torch.int32)
    lens = [rng.randrange(1, 21) for _ in range(3)]
    slots = TableSlots(tables, lens, 4)
    assert len(slots) == 3
    for b in range(3):
        assert slots[b].tolist() == [int(tables[b, p // 4]) * 4 + p % 4 for p in range(lens[b])]
    assert slots[-1].tolist() == slots[2].tolist()
