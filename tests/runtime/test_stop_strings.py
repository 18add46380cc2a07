"""StopMatcher (Aho-Corasick over the stop strings) against a brute-force search: the first stop string
to complete, the longest of those ending there, and the held-back length, on random texts fed in
random pieces."""

from __future__ import annotations

import random

import pytest
from qruntime.stop_strings import StopMatcher


def _first_completion(text: str, stops: list[str]) -> tuple[int, int] | None:
    """(end, length) of the stop string completing first in `text`; the longest on a tie."""
    hits = [(i + len(s), -len(s)) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return None
    end, neg = min(hits)
    return end, -neg


def _held(text: str, stops: list[str]) -> int:
    """The longest end of `text` that begins some stop string (brute force)."""
    return max((k for k in range(1, len(text) + 1) for s in stops if s.startswith(text[-k:])), default=0)


def test_matches_a_brute_force_search_on_random_text():
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    for _ in range(400):
        alphabet = rng.choice(["ab", "abc", "ab \n", "xyz\u00e9\U0001f600"])
        stops = ["".join(rng.choices(alphabet, k=rng.randrange(1, 6))) for _ in range(rng.randrange(1, 7))]
        text = "".join(rng.choices(alphabet, k=rng.randrange(0, 40)))
        matcher = StopMatcher(stops)
        fed = 0
        expected = _first_completion(text, stops)
        got = None
        while fed < len(text) and got is None:
            piece = text[fed : fed + rng.randrange(1, 6)]
            before = fed
            hit = matcher.feed(piece)
            fed += len(piece)
            if hit is not None:
                got = (before + hit[0], hit[1])
            else:
                assert matcher.held == _held(text[:fed], stops), (stops, text[:fed])
        assert got == expected, (stops, text)


def test_the_longest_stop_ending_first_wins():
    matcher = StopMatcher(["cd", "abcd", "bc"])
    assert matcher.feed("xabc") == (4, 2)  # "bc" ends first
    matcher = StopMatcher(["cd", "abcd"])
    assert matcher.feed("xabcd") == (5, 4)  # both end at 5: the one starting first


def test_held_text_spans_feeds():
    matcher = StopMatcher(["</tool_call>"])
    assert matcher.feed("result </to") is None and matcher.held == 4
    assert matcher.feed("ol_ca") is None and matcher.held == 9
    assert matcher.feed("ll> more") == (3, 12)


@pytest.mark.parametrize("stops", [[], [""], ["ok", ""], [None]])
def test_bad_stop_lists_are_refused(stops):
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(stops)
