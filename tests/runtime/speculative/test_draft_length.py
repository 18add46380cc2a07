"""Speculative decoding's knobs: SpeculativeConfig (and its parse() of the CLI's 'METHOD:key=value'),
the adaptive draft length of a request (engine/speculative/draft_length.py), and the Speculator's
per-request lengths and running counts."""

from __future__ import annotations

import pytest
from qruntime.engine.speculative.config import MAX_DRAFT_TOKENS, SpeculativeConfig
from qruntime.engine.speculative.draft_length import (
    FIRST_PAUSE,
    LOW_ACCEPTANCE,
    MAX_PAUSE,
    MISSES_TO_PAUSE,
    PAUSE_GROWTH,
    SMOOTHING,
    START_ACCEPTANCE,
    DraftLength,
    StepClock,
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


def test_each_method_has_its_default_k():
    """Prompt lookup drafts 12 unless told (its drafts cost no model step); the model drafters 4."""
    assert SpeculativeConfig().num_tokens == SpeculativeConfig.parse("prompt-lookup").num_tokens == 12
    assert SpeculativeConfig("draft-model", draft_model="/d").num_tokens == 4
    assert SpeculativeConfig("layer-skip").num_tokens == 4
    assert SpeculativeConfig("layer-skip", num_tokens=7).num_tokens == 7
    assert SpeculativeConfig.parse("draft-model:draft_model=/d,num_tokens=3").num_tokens == 3


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
    assert (length.k, length.acceptance, length.due, length.resume_at) == (4, START_ACCEPTANCE, True, 0)


def _run(length: DraftLength, steps: int, accepted=lambda k: 0) -> list[int]:
    """The clock's steps at which `length` drafted over `steps` steps, each draft's verification
    accepting `accepted(k)`."""
    drafted = []
    for _ in range(steps):
        if k := length.wanted():
            drafted.append(length.clock.now)
            length.record(k, accepted(k))
        length.clock.tick()
    return drafted


def test_a_draft_never_right_retries_after_growing_pauses_on_their_multiples():
    length = DraftLength(limit=4)
    # from START_ACCEPTANCE one verification accepting nothing pauses: 4 steps, then 16, 64 and 256,
    # each ending on a multiple of its length; and so on every MAX_PAUSE steps
    assert _run(length, 5000) == [0, 4, 16, 64, *range(256, 5000, MAX_PAUSE)]
    assert length.next_pause == MAX_PAUSE == FIRST_PAUSE * PAUSE_GROWTH**3


@pytest.mark.parametrize("now", [0, 1, 3, 5, 17, 100, 255, 256, 1000])
def test_a_pause_ends_on_a_multiple_of_its_length_half_to_one_and_a_half_lengths_away(now):
    for next_pause in (FIRST_PAUSE, 16, 64, MAX_PAUSE):
        length = DraftLength(limit=2, clock=StepClock(now), next_pause=next_pause)
        length.record(2, 0)
        assert length.resume_at % next_pause == 0, (now, next_pause)
        pause = length.resume_at - now
        assert next_pause // 2 < pause <= next_pause + next_pause // 2, (now, next_pause, pause)
        assert not length.due and length.wanted() == 0
        length.clock.now = length.resume_at
        assert length.due and length.wanted() == 1


def test_a_batch_of_failing_drafts_retries_in_the_same_steps():
    """Eight requests on one clock, arriving at different steps: once their pauses reach MAX_PAUSE
    they all draft on its multiples, one synchronous step for all instead of one each."""
    clock = StepClock()
    lengths = {}
    drafted: dict[int, list[int]] = {}
    for step in range(3000):
        if step % 37 == 0 and len(lengths) < 8:
            lengths[step] = DraftLength(limit=4, clock=clock)
        for arrival, length in lengths.items():
            if k := length.wanted():
                drafted.setdefault(clock.now, []).append(arrival)
                length.record(k, 0)
        clock.tick()
    late = {step: who for step, who in drafted.items() if step >= 1024}
    assert sorted(late) == list(range(1024, 3000, MAX_PAUSE))
    assert all(sorted(who) == sorted(lengths) for who in late.values()), late
    assert len(drafted) < 0.4 * sum(map(len, drafted.values()))  # steps that draft, against drafts made


def test_the_average_decides_when_to_pause():
    length = DraftLength(limit=4, acceptance=1.0)
    average = 1.0
    for step in range(20):
        accepted = step % 2  # alternately 0 and 1 of 4 accepted
        average = (1 - SMOOTHING) * average + SMOOTHING * accepted / 4
        length.record(4, accepted)
        if average < LOW_ACCEPTANCE:
            assert not length.due, step
            break
        assert length.due and length.wanted() == length.k, step
    else:
        raise AssertionError("the average never fell below LOW_ACCEPTANCE")


def test_one_failure_pauses_at_the_start_and_after_a_pause_and_one_accepted_draft_does_not():
    assert (1 - SMOOTHING) * START_ACCEPTANCE < LOW_ACCEPTANCE
    for accepted in range(1, 5):
        length = DraftLength(limit=4)
        length.record(4, accepted)
        assert length.due, accepted
    length = DraftLength(limit=4)
    length.record(4, 0)
    assert not length.due and length.acceptance == START_ACCEPTANCE  # paused, and resumes from it


def test_an_accepted_draft_resets_the_next_pause():
    length = DraftLength(limit=2)
    assert len(_run(length, 70)) == 4  # pauses of 4, 16 and 64 so far: 256 next
    assert length.next_pause == MAX_PAUSE
    length.clock.now = length.resume_at
    length.record(length.k, length.k)
    assert length.next_pause == FIRST_PAUSE
    good = DraftLength(limit=3)
    assert _run(good, 200, accepted=lambda k: k) == list(range(200))  # a draft always right never pauses
    assert good.k == 3


def test_not_adaptive_stays_at_the_limit():
    length = DraftLength(limit=3, adaptive=False)
    for accepted in [0, 0, 0, 0, 0, 1, 3, 0, 0, 0]:
        assert length.wanted() == 3
        length.record(3, accepted)
    assert (length.k, length.due) == (3, True)


def test_misses_in_a_row_pause_with_the_growing_pause_and_a_draft_resets_them():
    length = DraftLength(limit=4)
    resumed = []
    for _ in range(6):
        for _ in range(MISSES_TO_PAUSE - 1):
            length.miss()
            assert length.due
        length.miss()
        assert not length.due
        length.clock.now = length.resume_at  # the steps of the pause go by
        resumed.append(length.clock.now)
        assert length.wanted() == length.k
    assert resumed == [4, 16, 64, 256, 512, 768]
    length.miss()
    length.record(2, 1)  # a verification between misses: they are no longer in a row
    length.miss()
    assert length.due and length.misses == 1
    fixed = DraftLength(limit=3, adaptive=False)
    for _ in range(10):
        fixed.miss()
    assert fixed.due and fixed.wanted() == 3


def test_speculator_due_and_tick_follow_each_requests_pause():
    spec = Speculator(SpeculativeConfig(num_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1))
    assert spec.due("new")  # never asked: drafts at its first step
    for _ in range(MISSES_TO_PAUSE):
        assert spec.draft("a", [1, 2, 3], limit=4) == ()  # nothing repeats: a miss each
    assert spec.draft("b", [7, 8, 7], limit=4) == (8, 7)
    assert not spec.due("a") and spec.due("b")
    for step in range(FIRST_PAUSE):
        assert not spec.due("a") and spec.draft("a", [1, 2, 3, 1], limit=4) == (), step
        spec.tick()
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
    spec.record("a", 3, 1, 2)
    assert spec.draft("a", tokens, limit=8) == (3, 4)  # a's k fell to accepted + 1
    assert spec.draft("b", tokens, limit=8) == (3, 4, 5)  # b has its own
    spec.record("b", 3, 3, 4)
    assert spec.stats == SpeculativeStats(drafted=6, accepted=4, verifications=2, emitted=6)
    assert spec.stats.acceptance_rate == pytest.approx(4 / 6) and spec.stats.tokens_per_verification == 3
    spec.forget("a")
    assert spec.draft("a", tokens, limit=8) == (3, 4, 5)  # forgotten: a fresh length
    spec.record("gone", 2, 1, 2)  # a request it never drafted for: counted, no state made
    assert spec.stats.verifications == 3
    assert spec.draft("c", [1, 2, 3], limit=8) == ()  # nothing repeats


def test_speculator_pauses_a_request_whose_drafts_fail():
    spec = Speculator(SpeculativeConfig(num_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1))
    tokens = [7, 8, 7]
    drafted = []
    for _ in range(20):
        d = spec.draft("a", tokens, limit=4)
        drafted.append(len(d))
        if d:
            spec.record("a", len(d), 0, 1)
        spec.tick()
    # k falls to 1 and the pauses end on multiples of 4, then of 16
    assert drafted == [2, 0, 0, 0, 1] + [0] * 11 + [1, 0, 0, 0]
