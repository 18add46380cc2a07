"""Speculative decoding's knobs: SpeculativeConfig (and its parse() of the CLI's 'METHOD:key=value'),
the adaptive draft length of a request (engine/speculative/draft_length.py), and the Speculator's
per-request lengths and running counts."""

from __future__ import annotations

import pytest
from qruntime.engine.speculative.config import MAX_DRAFT_TOKENS, SpeculativeConfig
from qruntime.engine.speculative.draft_length import (
    LOW_ACCEPTANCE,
    MAX_PAUSE,
    MISSES_TO_PAUSE,
    SMOOTHING,
    DraftLength,
)
from qruntime.engine.speculative.proposers import PROPOSERS
from qruntime.engine.speculative.speculator import SpeculativeStats, Speculator

# ---- SpeculativeConfig ----


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("prompt-lookup", SpeculativeConfig()),
        ("  prompt-lookup  ", SpeculativeConfig()),
        ("prompt-lookup:", SpeculativeConfig()),
        ("prompt-lookup:num_tokens=6", SpeculativeConfig(num_tokens=6)),
        ("prompt-lookup:num-tokens=6", SpeculativeConfig(num_tokens=6)),  # dashes as in a CLI flag
        (
            "prompt-lookup: num_tokens = 3 , adaptive=false, prompt_lookup_min=1,prompt_lookup_max=5",
            SpeculativeConfig(num_tokens=3, adaptive=False, prompt_lookup_min=1, prompt_lookup_max=5),
        ),
        ("prompt-lookup:adaptive=TRUE", SpeculativeConfig(adaptive=True)),
        ("prompt-lookup:adaptive=0", SpeculativeConfig(adaptive=False)),
        ("prompt-lookup:adaptive=1,", SpeculativeConfig(adaptive=True)),
        (f"prompt-lookup:num_tokens={MAX_DRAFT_TOKENS}", SpeculativeConfig(num_tokens=MAX_DRAFT_TOKENS)),
        (
            "prompt-lookup:prompt_lookup_min=3,prompt_lookup_max=3",
            SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=3),
        ),
    ],
)
def test_parse_good_strings(text, expected):
    assert SpeculativeConfig.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ngram", "speculative method 'ngram' is unknown; choose one of prompt-lookup"),
        ("", "speculative method '' is unknown; choose one of prompt-lookup"),
        (":num_tokens=3", "speculative method '' is unknown"),
        ("prompt-lookup:num_tokens", "option 'num_tokens': expected key=value with key one of num_tokens, adaptive"),
        ("prompt-lookup:k=3", "option 'k=3': expected key=value"),
        ("prompt-lookup:method=prompt-lookup", "option 'method=prompt-lookup': expected key=value"),
        ("prompt-lookup:num_tokens=three", "option num_tokens: expected an integer (got 'three')"),
        ("prompt-lookup:num_tokens=2.5", "option num_tokens: expected an integer (got '2.5')"),
        ("prompt-lookup:num_tokens=", "option num_tokens: expected an integer (got '')"),
        ("prompt-lookup:adaptive=yes", "option adaptive: expected true or false (got 'yes')"),
        ("prompt-lookup:num_tokens=0", f"num_tokens must be 1..{MAX_DRAFT_TOKENS} (got 0)"),
        (f"prompt-lookup:num_tokens={MAX_DRAFT_TOKENS + 1}", f"(got {MAX_DRAFT_TOKENS + 1})"),
        ("prompt-lookup:prompt_lookup_min=0", "1 <= prompt_lookup_min <= prompt_lookup_max (got 0, 4)"),
        ("prompt-lookup:prompt_lookup_min=5", "(got 5, 4)"),
        ("prompt-lookup:prompt_lookup_max=1", "(got 2, 1)"),
    ],
)
def test_parse_bad_strings_name_the_problem(text, message):
    with pytest.raises(ValueError) as caught:
        SpeculativeConfig.parse(text)
    assert message in str(caught.value)


def test_an_unknown_method_lists_every_known_one():
    with pytest.raises(ValueError) as caught:
        SpeculativeConfig(method="eagle")
    assert all(name in str(caught.value) for name in PROPOSERS) and "'eagle'" in str(caught.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_tokens": 0},
        {"num_tokens": -1},
        {"num_tokens": MAX_DRAFT_TOKENS + 1},
        {"prompt_lookup_min": 0},
        {"prompt_lookup_min": 3, "prompt_lookup_max": 2},
    ],
)
def test_bounds(kwargs):
    with pytest.raises(ValueError):
        SpeculativeConfig(**kwargs)


def test_the_edges_of_the_bounds_are_accepted():
    SpeculativeConfig(num_tokens=1, prompt_lookup_min=1, prompt_lookup_max=1)
    SpeculativeConfig(num_tokens=MAX_DRAFT_TOKENS, prompt_lookup_min=7, prompt_lookup_max=7)


# ---- DraftLength ----


def test_full_acceptance_grows_k_by_one_up_to_the_limit():
    length = DraftLength(limit=5)
    assert length.wanted() == 5  # starts at the limit
    length.record(5, 2)
    assert length.wanted() == 3  # lost some: accepted + 1
    ks = []
    for _ in range(4):
        k = length.wanted()
        length.record(k, k)
        ks.append(length.wanted())
    assert ks == [4, 5, 5, 5]


def test_partial_acceptance_drops_k_to_accepted_plus_one():
    for proposed in range(1, 7):
        for accepted in range(proposed):
            length = DraftLength(limit=6)
            length.record(proposed, accepted)
            assert length.k == accepted + 1, (proposed, accepted)
            assert length.k <= length.limit


def test_proposing_nothing_changes_nothing():
    length = DraftLength(limit=4)
    length.record(0, 0)
    assert (length.k, length.acceptance, length.pause) == (4, 1.0, 0)


def test_low_acceptance_pauses_with_a_doubling_pause_up_to_the_cap():
    length = DraftLength(limit=4)
    pauses = []
    for i in range(12):
        misses = 0
        while length.wanted():  # drafts rejected until the average falls below LOW_ACCEPTANCE
            length.record(length.k, 0)
            misses += 1
            assert misses < 10, "never paused"
        # from 1.0: 0.5, 0.25, 0.125; back from a pause at 0.5 (the benefit of the doubt): 0.25, 0.125
        assert misses == (3 if i == 0 else 2), i
        paused = 1
        while not length.wanted():  # the pause counts steps, the first included
            paused += 1
        pauses.append(paused)
    expected = [min(4 * 2**i, MAX_PAUSE) for i in range(12)]
    assert pauses == expected


def test_the_average_decides_when_to_pause():
    length = DraftLength(limit=4)
    average = 1.0
    for step in range(20):
        accepted = step % 2  # alternately 0 and 1 of 4 accepted
        average = (1 - SMOOTHING) * average + SMOOTHING * accepted / 4
        length.record(4, accepted)
        if average < LOW_ACCEPTANCE:
            assert length.pause > 0, step
            break
        assert length.pause == 0 and length.wanted() == length.k, step
    else:
        raise AssertionError("the average never fell below LOW_ACCEPTANCE")


def test_an_accepted_draft_resets_the_next_pause():
    length = DraftLength(limit=2)
    for _ in range(3):  # three pauses: 4, 8, 16 next
        while length.wanted():
            length.record(length.k, 0)
        while not length.wanted():
            pass
    assert length.next_pause == 32
    length.record(length.k, length.k)
    assert length.next_pause == 4


def test_not_adaptive_stays_at_the_limit():
    length = DraftLength(limit=3, adaptive=False)
    for accepted in [0, 0, 0, 0, 0, 1, 3, 0, 0, 0]:
        assert length.wanted() == 3
        length.record(3, accepted)
    assert (length.k, length.pause) == (3, 0)


def test_misses_in_a_row_pause_with_the_doubling_pause_and_a_draft_resets_them():
    length = DraftLength(limit=4)
    pauses = []
    for _ in range(6):
        for _ in range(MISSES_TO_PAUSE - 1):
            length.miss()
            assert length.due and length.pause == 0
        length.miss()
        assert not length.due
        pauses.append(length.pause)
        while not length.due:  # asynchronous steps count the pause as wanted() does
            length.skip()
        assert length.wanted() == length.k
    assert pauses == [min(4 * 2**i, MAX_PAUSE) for i in range(6)]
    length.miss()
    length.record(2, 1)  # a verification between misses: they are no longer in a row
    length.miss()
    assert length.due and length.misses == 1
    length.skip()  # not paused: nothing to count
    assert length.pause == 0
    fixed = DraftLength(limit=3, adaptive=False)
    for _ in range(10):
        fixed.miss()
    assert fixed.due and fixed.wanted() == 3


def test_speculator_due_and_skip_follow_each_requests_pause():
    spec = Speculator(SpeculativeConfig(num_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1))
    assert spec.due("new")  # never asked: drafts at its first step
    for _ in range(MISSES_TO_PAUSE):
        assert spec.draft("a", [1, 2, 3], limit=4) == ()  # nothing repeats: a miss each
    assert spec.draft("b", [7, 8, 7], limit=4) == (8, 7)
    assert not spec.due("a") and spec.due("b")
    for _ in range(4):
        spec.skip(["a", "b", "unknown"])
    assert spec.due("a") and spec.draft("a", [1, 2, 3, 1], limit=4) == (2, 3)


# ---- Speculator ----


def test_stats_accumulate():
    stats = SpeculativeStats()
    assert (stats.acceptance_rate, stats.tokens_per_verification) == (0.0, 0.0)
    for drafted, accepted, emitted in [(4, 4, 5), (3, 1, 2), (2, 0, 1)]:
        stats = stats.add(drafted, accepted, emitted)
    assert stats == SpeculativeStats(drafted=9, accepted=5, verifications=3, emitted=8)
    assert stats.acceptance_rate == pytest.approx(5 / 9) and stats.tokens_per_verification == pytest.approx(8 / 3)


def test_speculator_drafts_per_request_and_records():
    spec = Speculator(SpeculativeConfig(num_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2))
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert spec.draft("a", tokens, limit=8) == (3, 4, 5)  # k = num_tokens at first
    assert spec.draft("a", tokens, limit=2) == (3, 4)  # the scheduler's limit caps it
    spec.record("a", 3, 0, 1)
    assert spec.draft("a", tokens, limit=8) == (3,)  # a's k fell to 1
    assert spec.draft("b", tokens, limit=8) == (3, 4, 5)  # b has its own
    spec.record("b", 3, 3, 4)
    assert spec.stats == SpeculativeStats(drafted=6, accepted=3, verifications=2, emitted=5)
    assert spec.stats.acceptance_rate == 0.5 and spec.stats.tokens_per_verification == 2.5
    spec.forget("a")
    assert spec.draft("a", tokens, limit=8) == (3, 4, 5)  # forgotten: a fresh length
    spec.record("gone", 2, 1, 2)  # a request it never drafted for: counted, no state made
    assert spec.stats.verifications == 3
    assert spec.draft("c", [1, 2, 3], limit=8) == ()  # nothing repeats


def test_speculator_pauses_a_request_whose_drafts_fail():
    spec = Speculator(SpeculativeConfig(num_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1))
    tokens = [7, 8, 7]
    drafted = []
    for _ in range(12):
        d = spec.draft("a", tokens, limit=4)
        drafted.append(len(d))
        if d:
            spec.record("a", len(d), 0, 1)
    assert drafted[:3] == [2, 1, 1] and drafted[3:7] == [0, 0, 0, 0] and drafted[7] == 1
