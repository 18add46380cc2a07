"""Prompt lookup (engine/speculative/proposers.py): the tokens that followed the latest earlier match
of the longest n-gram ending the sequence, hand-traced and against a brute-force Python reference."""

from __future__ import annotations

import pytest
from qruntime.engine.sampling_params import SamplingParams
from qruntime.engine.speculative.config import SpeculativeConfig
from qruntime.engine.speculative.draft import DraftFor
from qruntime.engine.speculative.proposers import PROPOSERS, PromptLookup


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """Prompt lookup spelled out: for n from max_n down to min_n, the latest earlier start s whose
    n tokens equal the last n (s < len - n), and up to k tokens after it."""
    if k < 1:
        return ()
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue  # no earlier n-gram can exist
        suffix = tokens[length - n :]
        for s in range(length - n - 1, -1, -1):
            if tokens[s : s + n] == suffix:
                return tuple(tokens[s + n : s + n + k])
    return ()


def test_the_latest_earlier_match_wins():
    lookup = PromptLookup(2, 2)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [7, 8, 1, 2, 7, 8, 3, 4, 7, 8]
    assert lookup.propose(tokens, 3) == (3, 4, 7)  # [7, 8] at 4, not at 0
    assert lookup.propose(tokens, 1) == (3,)


def test_the_longest_n_is_tried_first_then_shorter_ones():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 7, 8, 1, 2, 9, 7, 8, 3, 5, 7, 8]
    # [5, 7, 8] occurs at 0, while the shorter [7, 8] occurs later (at 6): the longer match is taken
    assert PromptLookup(2, 3).propose(tokens, 2) == (1, 2)
    assert PromptLookup(2, 2).propose(tokens, 2) == (3, 5)
    # no 4-gram repeats: 3 is tried next
    assert PromptLookup(1, 4).propose(tokens, 2) == (1, 2)
    # nothing of length 2 or more repeats: falls back to n = 1
    assert PromptLookup(1, 3).propose([4, 1, 2, 3, 4], 2) == (1, 2)
    assert PromptLookup(2, 3).propose([4, 1, 2, 3, 4], 2) == ()


def test_k_caps_the_draft_and_it_never_runs_past_the_end():
    tokens = [1, 2, 3, 4, 5, 1, 2]
    lookup = PromptLookup(2, 2)
    assert [lookup.propose(tokens, k) for k in range(0, 8)] == [
        (),
        (3,),
        (3, 4),
        (3, 4, 5),
        (3, 4, 5, 1),
        (3, 4, 5, 1, 2),  # up to the sequence's end: 5 tokens follow the match
        (3, 4, 5, 1, 2),
        (3, 4, 5, 1, 2),
    ]
    # an overlapping match just before the suffix: only the tokens up to the end follow it
    assert lookup.propose([9, 3, 3, 3], 4) == (3,)
    assert PromptLookup(1, 1).propose([6, 6], 5) == (6,)


@pytest.mark.parametrize(
    "tokens",
    [[], [1], [1, 2], [1, 2, 3, 4, 5], [1, 2, 1, 3]],
    ids=["empty", "one", "too-short", "no-repeat", "no-bigram-repeat"],
)
def test_nothing_to_propose(tokens):
    assert PromptLookup(2, 4).propose(tokens, 4) == ()


def test_k_zero_or_negative_proposes_nothing():
    assert PromptLookup(1, 2).propose([1, 2, 1, 2, 1], 0) == ()
    assert PromptLookup(1, 2).propose([1, 2, 1, 2, 1], -1) == ()


def test_matches_the_reference_on_random_sequences(rng):
    """Thousands of random sequences over a 2-4 letter alphabet (so that n-grams repeat, or not, in
    every way), random n ranges and k."""
    for _ in range(3000):
        alphabet = rng.randint(2, 4)
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(0, 24))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(0, 6)
        got = PromptLookup(min_n, max_n).propose(tokens, k)
        assert got == reference(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)
        assert all(isinstance(t, int) for t in got) and len(got) <= max(k, 0)


def test_the_registry_builds_prompt_lookup_from_the_config():
    proposer = PROPOSERS["prompt-lookup"](SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=3))
    assert isinstance(proposer, PromptLookup) and (proposer.min_n, proposer.max_n) == (1, 3)
    assert proposer.propose([4, 1, 2, 3, 4], 2) == (1, 2)


def test_a_requests_index_grows_with_its_tokens_and_matches_the_reference(rng):
    """Per request, the draft after each appended run of tokens (1-5 at a time, as accepted drafts
    arrive) equals the reference's over the whole sequence; a sequence that does not extend the
    indexed one (another request's tokens under a reused id) is indexed afresh; forget drops it."""
    for _ in range(300):
        alphabet, min_n = rng.randint(2, 5), rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        lookup = PromptLookup(min_n, max_n)
        request = DraftFor(f"r{rng.randrange(3)}", SamplingParams(), None)
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(0, 8))]
        for _ in range(rng.randint(1, 12)):
            tokens += [rng.randrange(alphabet) for _ in range(rng.randint(1, 5))]
            k = rng.randint(0, 6)
            assert lookup.propose(tokens, k, request) == reference(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)
        if len(tokens) > min_n + 1:  # other is long enough to be indexed
            other = [(t + 1) % alphabet for t in tokens[:-1]]  # shorter, different: not an extension
            assert lookup.propose(other, 3, request) == reference(other, 3, min_n, max_n)
            assert lookup._indexes[request.request_id].tokens == other
        lookup.forget(request.request_id)
        assert request.request_id not in lookup._indexes
