"""SamplingParams.max_thinking_tokens: after that many tokens inside an open <think> block the next
token is </think>. The block's state (thinking.ThinkingState), the sampler's forced rows (decided on
the device from the token in flight) and the engine with async scheduling, where the token before
the one being sampled is still on the device."""

from __future__ import annotations

import pytest
import qruntime
import torch
from qruntime.engine.outputs import InvalidRequest
from qruntime.engine.sampler import Forced, sample, sample_on_device
from qruntime.engine.sampling_params import InvalidSamplingParams, SamplingParams
from qruntime.engine.thinking import ThinkingState

OPEN, CLOSE = 7, 8


def test_the_state_follows_the_prompt_and_the_tokens():
    assert ThinkingState.of_prompt(3, OPEN, CLOSE, [1, OPEN, 2]).open
    assert not ThinkingState.of_prompt(3, OPEN, CLOSE, [OPEN, 2, CLOSE, 4]).open
    assert not ThinkingState.of_prompt(3, OPEN, CLOSE, [1, 2]).open
    state = ThinkingState.of_prompt(2, OPEN, CLOSE, [1, OPEN])
    assert state.mode(in_flight=False) is None and state.mode(in_flight=True) is None  # 0 known, 1 in flight < 2
    state.observe(5)
    assert state.mode(in_flight=False) is None and state.mode(in_flight=True) == "unless"
    state.observe(OPEN)  # inside the block, a <think> is a thinking token
    assert state.count == 2 and state.mode(in_flight=False) == "always"
    state.observe(CLOSE)
    assert not state.open and state.mode(in_flight=True) is None
    closed = ThinkingState.of_prompt(0, OPEN, CLOSE, [1])
    assert closed.mode(in_flight=False) is None and closed.mode(in_flight=True) == "when"


def test_forced_rows_are_decided_on_the_device_from_the_token_in_flight(rng):
    logits = torch.randn(5, 12)
    greedy = [SamplingParams(max_tokens=4)] * 5
    free = sample(logits, greedy, [None] * 5)
    in_flight = torch.tensor([CLOSE, 3, OPEN, 4])
    forced = Forced(
        CLOSE, always=(0,), unless=((1, 0), (2, 1)), unless_token=CLOSE, when=((3, 2), (4, 3)), when_token=OPEN
    )

    got = sample_on_device(logits, greedy, [None] * 5, in_flight=in_flight, forced=forced).tolist()
    # row 0 always; row 1's token in flight is </think> (already closed): free; row 2's is 3: forced;
    # row 3's token in flight is <think>: forced; row 4's is 4: free
    assert got == [CLOSE, free[1], CLOSE, CLOSE, free[4]]


@pytest.fixture(scope="module")
def engine(tiny_ckpt, compiled):
    return qruntime.load(compiled(tiny_ckpt, "bf16"), device="cpu", dtype="float32", max_model_len=128)


def _marks(engine) -> tuple[int, int]:
    backend = engine.tokenizer.backend
    return backend.token_to_id("<think>"), backend.token_to_id("</think>")


@pytest.mark.parametrize("cap", [0, 1, 2, 5])
def test_a_prompt_that_opens_thinking_is_closed_after_the_cap(engine, rng, cap):
    open_id, close_id = _marks(engine)
    prompt = [rng.randrange(10, 400) for _ in range(rng.randrange(3, 30))] + [open_id]
    # the model itself never opens or closes (bias -100): the one </think> is the forced one
    params = SamplingParams(
        max_tokens=cap + 6, ignore_eos=True, max_thinking_tokens=cap, logit_bias={open_id: -100, close_id: -100}
    )
    (out,) = engine.generate([prompt], params)
    assert out.token_ids[cap] == close_id and close_id not in out.token_ids[:cap] + out.token_ids[cap + 1 :], (
        out.token_ids
    )
    (uncapped,) = engine.generate(
        [prompt], SamplingParams(max_tokens=cap + 6, ignore_eos=True, logit_bias=params.logit_bias)
    )
    assert close_id not in uncapped.token_ids


@pytest.mark.parametrize("cap", [0, 2])
def test_blocks_the_model_opens_are_capped_each_time(engine, rng, cap):
    open_id, close_id = _marks(engine)
    prompt = [rng.randrange(10, 400) for _ in range(8)]
    # the model always picks <think> (bias 100): each block it opens holds `cap` tokens, then </think>
    params = SamplingParams(
        max_tokens=3 * (cap + 2), ignore_eos=True, max_thinking_tokens=cap, logit_bias={open_id: 100}
    )
    (out,) = engine.generate([prompt], params)
    assert list(out.token_ids) == ([open_id] * (cap + 1) + [close_id]) * 3


def test_bad_caps_are_refused(engine):
    with pytest.raises(InvalidSamplingParams, match="max_thinking_tokens"):
        SamplingParams(max_thinking_tokens=-1)
    with pytest.raises(InvalidSamplingParams, match="max_thinking_tokens"):
        SamplingParams(max_thinking_tokens=2.5)
    no_marks = type("NoMarks", (), {"backend": None})()
    original = engine.tokenizer
    engine.tokenizer = no_marks
    try:
        with pytest.raises(InvalidRequest, match="<think>"):
            engine.add_request([1, 2, 3], SamplingParams(max_thinking_tokens=3))
    finally:
        engine.tokenizer = original
