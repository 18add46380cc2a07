"""qruntime.bounded_json: depth and text bounds on JSON read from someone else's bytes."""

from __future__ import annotations

import json
import random
from typing import Any

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


def _random_document(rng: random.Random, depth: int) -> Any:
    """Nested dicts and lists of numbers and strings, some strings with surrogates (lone or paired)."""
    if depth == 0 or rng.random() < 0.3:
        pick = rng.random()
        if pick < 0.3:
            return rng.choice([1, -2.5, True, None])
        text = "".join(
            rng.choice(["a", "é", "\\", '"', "\U0001f600", "\ud800", "\udfff"]) for _ in range(rng.randrange(4))
        )
        return text if rng.random() < 0.5 or not any(0xD800 <= ord(c) <= 0xDFFF for c in text) else "plain"
    if rng.random() < 0.5:
        return [_random_document(rng, depth - 1) for _ in range(rng.randrange(3))]
    return {f"k{i}": _random_document(rng, depth - 1) for i in range(rng.randrange(3))}


def test_loads_refuses_exactly_what_the_named_walk_refuses():
    """loads walks (naming the place) only documents that may break a bound; over random documents,
    as str and as UTF-8, UTF-16 or surrogate-passing UTF-8 bytes, it refuses what json.loads + check
    refuses, with check's message, and returns json.loads' value otherwise."""
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    refused = accepted = 0
    for _ in range(400):
        doc = _random_document(rng, rng.randrange(1, 7))
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5)
        inputs = [text, text.encode("utf-8", "surrogatepass"), text.encode("utf-16", "surrogatepass")]
        max_depth = rng.randrange(1, 7)
        for raw in inputs:
            want = json.loads(raw)
            try:
                check(want, what="doc", max_depth=max_depth)
                expected = None
            except JSONLimitError as exc:
                expected = str(exc)
            try:
                got = loads(raw, what="doc", max_depth=max_depth)
            except JSONLimitError as exc:
                assert str(exc) == expected, raw
                refused += 1
            else:
                assert expected is None and got == want, raw
                accepted += 1
    assert refused > 100 and accepted > 100, (refused, accepted)


def test_an_escaped_backslash_before_u_d800_is_text():
    assert loads('{"a": "\\\\ud800"}', what="doc") == {"a": "\\ud800"}
    assert loads(b'{"a": "\\\\ud800"}', what="doc") == {"a": "\\ud800"}
