"""Logprobs of generated and prompt tokens (SamplingParams.logprobs / prompt_logprobs) against a
log_softmax of the reference path's logits (fp32, CPU): Engine.score gives every position's logits
of the same sequence in one forward pass."""

from __future__ import annotations

import pytest
import qruntime
import torch
from qruntime.engine.outputs import RequestOutput, Timings, TokenLogprob
from qruntime.engine.sampling_params import InvalidSamplingParams, SamplingParams

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def engine(tiny_ckpt, compiled):
    # a small token budget: prompts are prefilled in several chunks, some beside decodes
    return qruntime.load(
        compiled(tiny_ckpt, "bf16"), device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=48
    )


def _reference(engine, prompt: list[int], output: RequestOutput) -> torch.Tensor:
    """log_softmax (fp64) of the logits after every position of prompt + outputs."""
    return torch.log_softmax(engine.score(prompt + list(output.token_ids)).double(), dim=-1)


def _check(entry: TokenLogprob, row: torch.Tensor, token: int, k: int) -> None:
    assert entry.token_id == token
    assert abs(entry.logprob - row[token].item()) <= TOLERANCE, (entry.logprob, row[token].item())
    assert len(entry.top) == k
    values, ids = row.topk(k)
    for (top_id, top_lp), want_lp in zip(entry.top, values.tolist(), strict=True):
        assert abs(top_lp - want_lp) <= TOLERANCE and abs(row[top_id].item() - top_lp) <= TOLERANCE
    assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
    # the rank: 1 + the tokens above it (fp64 reference; a near-tie within the tolerance may swap them)
    above = int((row > row[token] + TOLERANCE).sum())
    assert above + 1 <= entry.rank <= int((row > row[token] - TOLERANCE).sum()), (entry.rank, above)


def test_logprobs_are_the_models_log_softmax_for_every_request_of_a_batch(engine, rng):
    vocab = engine.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 120))] for _ in range(5)]
    params = [
        SamplingParams(max_tokens=9, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        SamplingParams(max_tokens=7, ignore_eos=True, logprobs=0),
        SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=0),
        # sampled hot: the logprobs stay the model's (before the temperature, the bias and the penalty)
        SamplingParams(
            max_tokens=8,
            ignore_eos=True,
            temperature=1.7,
            seed=rng.randrange(1 << 30),
            logprobs=5,
            logit_bias={3: 7.0},
            presence_penalty=1.5,
        ),  # fmt: skip
        SamplingParams(max_tokens=5, ignore_eos=True),
    ]
    outputs = engine.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        reference = _reference(engine, prompt, out)
        n = len(prompt)
        if p.logprobs is None:
            assert out.logprobs is None
        else:
            assert len(out.logprobs) == len(out.token_ids)
            for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
                _check(entry, reference[n - 1 + j], token, p.logprobs)
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert len(out.prompt_logprobs) == n and out.prompt_logprobs[0] is None
            for i in range(1, n):
                _check(out.prompt_logprobs[i], reference[i - 1], prompt[i], p.prompt_logprobs)


def test_prompt_logprobs_compute_the_whole_prompt_and_other_requests_still_hit_the_cache(engine, rng):
    vocab = engine.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(100)]  # six full 16-token blocks
    engine.generate([prompt], SamplingParams(max_tokens=2))  # its blocks are cached now
    before = engine.prefix_cache_stats
    scored = engine.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    assert engine.prefix_cache_stats.hits == before.hits  # looked up nothing: every position computed
    assert len(scored.prompt_logprobs) == 100 and scored.num_cached_tokens == 0
    reference = _reference(engine, prompt, scored)
    for i in range(1, 100):
        _check(scored.prompt_logprobs[i], reference[i - 1], prompt[i], 1)
    engine.generate([prompt], SamplingParams(max_tokens=2))
    assert engine.prefix_cache_stats.hits >= before.hits + 96


def test_streamed_deltas_carry_the_logprobs_of_their_tokens(engine, rng):
    prompt = [rng.randrange(engine.vocab_size) for _ in range(30)]
    deltas = list(engine.stream(prompt, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)))
    ids = [t for d in deltas for t in d.token_ids]
    entries = [e for d in deltas for e in d.logprobs]
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    out = deltas[-1].output
    assert ids == list(out.token_ids) and entries == list(out.logprobs)
    assert [e.token_id for e in entries] == ids


def test_a_stop_string_cut_drops_the_logprobs_after_it():
    entries = tuple(TokenLogprob(i, -float(i)) for i in range(5))
    out = RequestOutput("r", (1, 2), (10, 11, 12, 13, 14), "", "length", None, Timings(0, 0, 1, 5), 0, logprobs=entries)
    cut = out.stopped_at(3, "x")
    assert cut.token_ids == (10, 11, 12) and cut.logprobs == entries[:3]


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, 2.0, True])
def test_logprob_counts_outside_0_to_20_are_refused(field, value):
    with pytest.raises(InvalidSamplingParams, match=field):
        SamplingParams(**{field: value})


def test_the_reference_check_fails_a_logprob_off_by_one_position(engine, rng):
    prompt = [rng.randrange(engine.vocab_size) for _ in range(20)]
    out = engine.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True, logprobs=1))[0]
    reference = _reference(engine, prompt, out)
    _check(out.logprobs[1], reference[len(prompt)], out.token_ids[1], 1)
    for wrong in (len(prompt) - 1, len(prompt) + 1):
        with pytest.raises(AssertionError):
            _check(out.logprobs[1], reference[wrong], out.token_ids[1], 1)
