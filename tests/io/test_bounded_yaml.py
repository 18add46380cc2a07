"""qcompile.io.bounded_yaml: YAML from others' bytes without aliases, deep nesting or unbounded size;
qcompile.errors.shown: what an error echoes of such a value, bounded whatever it is."""

from __future__ import annotations

import random
import time

import pytest
import yaml
from qruntime.shown import SHOWN_CHARS, shown

from qcompile.io.bounded_yaml import MAX_CHARS, MAX_DEPTH, YAMLLimitError, loads


@pytest.fixture
def rng() -> random.Random:
    seed = random.randrange(1 << 32)
    print(f"bounded_yaml seed: {seed}")
    return random.Random(seed)


def _document(rng: random.Random, depth: int) -> object:
    """A random value of mappings, lists and scalars nested exactly `depth` containers deep."""
    if depth == 0:
        return rng.choice([rng.randrange(-(10**9), 10**9), rng.random(), f"s{rng.randrange(10**6)}", True, None])
    if rng.random() < 0.5:
        return [_document(rng, depth - 1)] + [_document(rng, 0) for _ in range(rng.randrange(3))]
    return {f"k{i}": _document(rng, depth - 1 if i == 0 else 0) for i in range(rng.randrange(1, 4))}


def test_documents_within_the_bounds_load_as_safe_load_does(rng):
    for _ in range(50):
        text = yaml.safe_dump(_document(rng, rng.randrange(1, MAX_DEPTH + 1)), default_flow_style=rng.random() < 0.5)
        assert loads(text, what="doc") == yaml.safe_load(text)


def test_depth_is_bounded_at_max_depth(rng):
    flow = lambda depth: "[" * depth + "1" + "]" * depth  # noqa: E731
    assert loads(flow(MAX_DEPTH), what="doc") is not None
    depth = rng.randrange(MAX_DEPTH + 1, 20_000)
    start = time.perf_counter()
    with pytest.raises(YAMLLimitError, match=rf"r\.yaml: line 1: nested more than {MAX_DEPTH} levels deep"):
        loads(flow(depth), what="r.yaml")
    assert time.perf_counter() - start < 2


@pytest.mark.parametrize(
    "text",
    ["a: &x 1\nb: *x\n", "a: &x [1, 2]\n", "- &x {k: v}\n- *x\n", "base: &b {k: 1}\nc:\n  <<: *b\n"],
    ids=["scalar alias", "unused anchor", "mapping alias", "merge key"],
)
def test_anchors_and_aliases_are_refused(text):
    with pytest.raises(YAMLLimitError, match=r"r\.yaml: line \d+: YAML anchors and aliases"):
        loads(text, what="r.yaml")


def test_size_and_long_integers_are_errors(rng):
    with pytest.raises(YAMLLimitError, match=rf"r\.yaml: {MAX_CHARS + 1:,} characters of YAML"):
        loads("#" * (MAX_CHARS + 1), what="r.yaml")
    digits = rng.randrange(4301, 10_000)
    with pytest.raises(yaml.YAMLError, match=r"r\.yaml: a value cannot be read"):
        loads(f"n: {'9' * digits}", what="r.yaml")


def test_shown_is_bounded_whatever_the_value(rng):
    nested: list = []
    inner = nested
    for _ in range(rng.randrange(1000, 100_000)):
        inner.append([])
        inner = inner[0]
    values = [
        "x" * rng.randrange(100, 10**6),
        10 ** rng.randrange(5000, 20_000),  # repr() refuses past 4300 digits
        nested,  # repr() recurses past the stack
        list(range(rng.randrange(100, 10**5))),
        {f"k{i}": "v" * 1000 for i in range(100)},
        b"\xff" * 1000,
    ]
    for value in values:
        text = shown(value)
        assert len(text) <= SHOWN_CHARS, text
    assert shown("short") == "'short'" and shown(42) == "42" and shown([1, 2]) == "[1, 2]"
