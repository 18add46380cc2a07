"""qruntime.bounded_json: depth and text bounds on JSON read from someone else's bytes."""

from __future__ import annotations

import json
import random

import pytest
from qruntime.bounded_json import MAX_DEPTH, JSONLimitError, check, loads


def _nested(depth: int, rng: random.Random) -> str:
    """`depth` containers inside each other, arrays and objects mixed at random."""
    opens, closes = [], []
    for _ in range(depth):
        if rng.random() < 0.5:
            opens.append("[")
            closes.append("]")
        else:
            opens.append('{"k":')
            closes.append("}")
    return "".join(opens) + "1" + "".join(reversed(closes))


def test_documents_within_the_bounds_parse_as_json_does():
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    for depth in (0, 1, MAX_DEPTH):
        text = _nested(depth, rng)
        assert loads(text, what="doc") == json.loads(text)
        assert loads(text.encode(), what="doc") == json.loads(text)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5_000, 200_000])
def test_deep_nesting_is_a_limit_error_not_a_recursion_error(depth):
    rng = random.Random(depth)
    with pytest.raises(JSONLimitError, match=r"manifest\.json: nested more than 64 levels"):
        loads(_nested(depth, rng), what="manifest.json")


def test_the_depth_bound_is_the_callers():
    assert loads("[[[1]]]", what="doc", max_depth=3) == [[[1]]]
    with pytest.raises(JSONLimitError, match="more than 2 levels"):
        loads("[[[1]]]", what="doc", max_depth=2)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('{"prompt": "ab\\ud800cd"}', "at prompt"),
        ('{"stop": ["ok", "\\udfff"]}', r"at stop\[1\]"),
        ('{"prompt": [1, 2.5, true, null, -3, "\\udc00"]}', r"at prompt\[5\]"),  # past the numbers
        ('{"a": {"\\ud83d": 1}}', "at a"),  # a key, half of a surrogate pair
    ],
)
def test_a_lone_surrogate_is_refused_with_its_place(text, where):
    with pytest.raises(JSONLimitError, match=f"request body: a string {where} holds a lone surrogate"):
        loads(text, what="request body")


def test_a_surrogate_pair_is_text():
    assert loads('{"emoji": "\\ud83d\\ude00"}', what="doc") == {"emoji": "\U0001f600"}


def test_check_walks_a_parsed_value():
    check({"a": [1, "x", {"b": None}]}, what="doc")
    with pytest.raises(JSONLimitError, match="lone surrogate"):
        check({"a": [1, "\udc80"]}, what="doc")


def test_malformed_json_stays_a_decode_error():
    with pytest.raises(json.JSONDecodeError):
        loads("{", what="doc")


def test_a_container_after_numbers_is_still_walked():
    inner = "[" * 70 + "1" + "]" * 70
    with pytest.raises(JSONLimitError, match="nested more than 64 levels"):
        loads(f'{{"prompt": [1, 2, 3, {inner}]}}', what="request body")
