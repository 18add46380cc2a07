"""A request's handle hands its reader everything queued at once, each choice's deltas merged, so a
lagging event loop sends one chunk per choice per wake-up; nothing is lost or reordered, and a
failure comes after the deltas queued before it."""

from __future__ import annotations

import asyncio
import random

import pytest
from qruntime import SamplingParams
from qruntime.engine.outputs import StreamDelta
from qruntime.serve.engine_client import FailedRequest, Handle
from qruntime.serve.engine_loop import Failure
from qruntime.serve.protocol import SequenceSpec


class _Owner:
    def abort(self, handle: Handle) -> None:
        pass


def _handle(choices: int) -> Handle:
    specs = tuple(SequenceSpec(i, 0, (1,), SamplingParams()) for i in range(choices))
    return Handle(_Owner(), "req", specs)


def _random_stream(rng: random.Random, choices: int) -> list[tuple[int, StreamDelta]]:
    """Each choice's deltas (1-3 tokens each, the last finished), interleaved at random."""
    per_choice = []
    for index in range(choices):
        deltas = []
        for _ in range(rng.randrange(1, 8)):
            ids = tuple(rng.randrange(1000) for _ in range(rng.randrange(0, 3)))
            deltas.append(StreamDelta(f"req-{index}", ids, "".join(chr(97 + t % 26) for t in ids), False))
        last = deltas[-1]
        deltas[-1] = StreamDelta(last.request_id, last.token_ids, last.text, True, None)
        per_choice.append([(index, d) for d in deltas])
    stream = []
    while any(per_choice):
        stream.append(rng.choice([c for c in per_choice if c]).pop(0))
    return stream


def test_a_lagging_reader_gets_each_choice_merged_in_order(rng):
    async def main() -> None:
        choices = rng.randrange(1, 4)
        handle = _handle(choices)
        stream = _random_stream(rng, choices)
        got: dict[int, list[StreamDelta]] = {i: [] for i in range(choices)}
        reads = 0
        position = 0
        while not handle.done:
            burst = rng.randrange(1, 6)  # the engine delivers several steps before the reader wakes
            for item in stream[position : position + burst]:
                handle.queue.put_nowait(item)
            position += burst
            batch = await handle.get_merged()
            assert handle.queue.empty(), "a read left queued deltas behind"
            reads += 1
            assert len({index for index, _ in batch}) == len(batch), "a choice twice in one read"
            for index, delta in batch:
                got[index].append(delta)
        assert reads <= len(stream)
        for index in range(choices):
            sent = [d for i, d in stream if i == index]
            joined = [t for d in got[index] for t in d.token_ids]
            assert joined == [t for d in sent for t in d.token_ids]
            assert "".join(d.text for d in got[index]) == "".join(d.text for d in sent)
            assert [d.finished for d in got[index]] == [False] * (len(got[index]) - 1) + [True]

    asyncio.run(main())


def test_a_failure_comes_after_the_deltas_before_it(rng):
    async def main() -> None:
        handle = _handle(1)
        handle.queue.put_nowait((0, StreamDelta("req-0", (5,), "x", False)))
        handle.queue.put_nowait((0, StreamDelta("req-0", (6,), "y", False)))
        handle.queue.put_nowait(Failure(500, "the engine failed"))
        batch = await handle.get_merged()
        assert [(i, d.token_ids, d.text) for i, d in batch] == [(0, (5, 6), "xy")]
        with pytest.raises(FailedRequest, match="the engine failed"):
            await handle.get_merged()
        assert handle.done
        other = _handle(2)
        other.queue.put_nowait(Failure(400, "bad"))
        with pytest.raises(FailedRequest, match="bad"):
            await other.get_merged()

    asyncio.run(main())
