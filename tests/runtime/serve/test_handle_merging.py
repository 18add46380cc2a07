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


class _RecordingOwner:
    def __init__(self) -> None:
        self.aborted, self.stopped = 0, []

    def abort(self, handle: Handle) -> None:
        self.aborted += 1

    def stop_sequence(self, handle: Handle, index: int, num_tokens: int, stop: str) -> None:
        self.stopped.append((index, num_tokens, stop))


def _output(ids, reason="length"):
    from qruntime.engine.outputs import RequestOutput, Timings

    return RequestOutput("req-0", (1, 2), tuple(ids), "", reason, None, Timings(0.0, 0.1, 0.2, len(ids)), 0)


def test_the_handle_turns_ids_into_text_and_ends_at_a_stop_string(tiny_ckpt, rng):
    """Ids in, text out (as the engine's own detokenizer makes it); at a stop string the tokens after
    it are dropped, the owner asked once to end that sequence, and its final output cut to match."""
    from qruntime.tokenizer import IncrementalDetokenizer, Tokenizer

    tok = Tokenizer.from_dir(tiny_ckpt)
    for _ in range(50):  # random ids whose text has a stop string to cut at, with tokens after it
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(12, 30))]
        free = IncrementalDetokenizer(tok, [1, 2])
        text = "".join(free.add(i) for i in ids) + free.flush()
        if len(text) < 8:
            continue
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        reference = IncrementalDetokenizer(tok, [1, 2], stop=[stop])
        cut = next((k + 1 for k, i in enumerate(ids) if (reference.add(i), reference.stop_matched)[1]), None)
        if cut is not None and cut < len(ids) and "\ufffd" not in stop:
            break
    else:
        pytest.fail("no random ids gave a text to cut")
    print("stop", repr(stop), "cut", cut, "of", len(ids))

    async def main() -> None:
        owner = _RecordingOwner()
        spec = SequenceSpec(0, 0, (1, 2), SamplingParams(max_tokens=64, stop=(stop,)))
        handle = Handle(owner, "req", (spec,), tok)
        got: list[StreamDelta] = []
        position = 0
        while position < len(ids):  # the engine sends 1-3 ids a turn, and a few more after the stop
            step = rng.randrange(1, 4)
            handle.queue.put_nowait((0, StreamDelta("req-0", tuple(ids[position : position + step]), "", False)))
            position += step
            got += [d for _, d in await handle.get_merged()]
        assert owner.stopped == [(0, cut, stop)] and not handle.done
        handle.queue.put_nowait((0, StreamDelta("req-0", (), "", True, _output(ids, "abort"))))
        got += [d for _, d in await handle.get_merged()]
        assert handle.done and owner.aborted == 0
        assert [t for d in got for t in d.token_ids] == ids[:cut]
        assert "".join(d.text for d in got) == reference.text == text[: text.index(stop)]
        final = got[-1].output
        assert (final.finish_reason, final.stop_reason, final.token_ids, final.text) == (
            "stop", stop, tuple(ids[:cut]), reference.text
        )  # fmt: skip
        assert final.timings.num_output_tokens == cut

    asyncio.run(main())


def test_a_tokenizer_failure_fails_the_request_alone(tiny_ckpt, rng):
    from qruntime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_ckpt)

    async def main() -> None:
        owner = _RecordingOwner()
        handle = Handle(owner, "req", (SequenceSpec(0, 0, (1, 2), SamplingParams()),), tok)
        handle.queue.put_nowait((0, StreamDelta("req-0", (rng.randrange(300, 2000),), "", False)))
        assert len(await handle.get_merged()) == 1

        def broken(token: int) -> str:
            raise RuntimeError("the tokenizer broke")

        handle._texts[0].detok.add = broken
        handle.queue.put_nowait((0, StreamDelta("req-0", (5,), "", False)))
        with pytest.raises(FailedRequest, match="turning its tokens into text failed"):
            await handle.get_merged()
        assert owner.aborted == 1 and handle.done

    asyncio.run(main())
