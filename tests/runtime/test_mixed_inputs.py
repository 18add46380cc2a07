"""The mixed graphs' host buffers (engine/mixed_inputs.py): every input starts 16-byte aligned
whatever the sizes (Triton specializes pointers on it), and a step's two copies cover its inputs."""

from __future__ import annotations

import pytest
import torch
from qruntime.engine.mixed_inputs import MixedInputs
from qruntime.engine.step_chunk import StepChunk


@pytest.mark.parametrize("mrope", [False, True])
def test_every_input_starts_aligned_and_the_spans_cover_a_step(rng, mrope):
    size, seqs, blocks, work = rng.randrange(3, 99), rng.randrange(1, 9), rng.randrange(1, 9), rng.randrange(0, 33)
    print("size, max_seqs, max_blocks, work", size, seqs, blocks, work)
    host = MixedInputs(size, seqs, blocks, work, block_size=4, scratch_block=7, pin=False, mrope=mrope)
    for name, view in host.tensors.items():
        base = host.wide if view.dtype == torch.int64 else host.narrow
        assert (view.data_ptr() - base.data_ptr()) % 16 == 0, name
    assert host.tensors["block_tables"].shape == (seqs, blocks) and host.tensors["work"].numel() == work
    assert host.tensors["positions"].shape == ((3, size) if mrope else (size,))
    # a step of n sequences: the narrow span ends with the n-th sequence's block table
    n = rng.randrange(1, seqs + 1)
    chunks = [StepChunk((5,), rng.randrange(0, 4 * blocks), tuple(range(blocks))) for _ in range(n)]
    step = host.fill(chunks, bucket=max(n, 1), all_logits=False)
    wide, narrow = host.spans(n)
    end = host.tensors["block_tables"][n - 1].data_ptr() + blocks * 4
    assert narrow.data_ptr() + narrow.numel() * 4 == end and wide is host.wide
    assert step.tokens == n and step.context_lens == tuple(c.start + 1 for c in chunks)
    assert host.tensors["query_start_loc"].tolist() == [*range(n + 1), *[n] * (seqs - n)]
