"""JSON from someone else's bytes, with bounds: a request body, a manifest, a config, a safetensors header.

`json.loads` has no depth limit of its own (deep nesting ends in RecursionError, or a stack that Python
only just catches) and accepts strings no UTF-8 text can hold (lone surrogates written as `\\ud800`),
which later break whatever encodes them (a tokenizer, a file name, a response). `loads` turns both into
a `JSONLimitError` naming where in the document the problem is, so every reader reports bad input the
same way, as a ValueError its caller already handles.
"""

from __future__ import annotations

import json
import re
from typing import Any

from qruntime.shown import clip

MAX_DEPTH = 64  # arrays/objects inside each other; every document we read needs fewer than 10
_SCALARS = frozenset({int, float, bool, type(None)})  # what json.loads makes that holds no string or container
_CONTAINERS = frozenset({dict, list})  # what json.loads makes that holds other values


class JSONLimitError(ValueError):
    """The document is valid JSON but past a bound: too deeply nested, or a string that is not text."""


def loads(raw: str | bytes, *, what: str, max_depth: int = MAX_DEPTH) -> Any:
    """Parse `raw` (UTF-8 bytes or str); `what` names the document in errors.

    Raises json.JSONDecodeError / UnicodeDecodeError for malformed input (both ValueErrors) and
    JSONLimitError for nesting deeper than `max_depth` or a string holding a lone surrogate.
    """
    try:
        value = json.loads(raw)
    except RecursionError:
        raise JSONLimitError(f"{what}: nested more than {max_depth} levels deep") from None
    # the walk that names the place (check) only where something may be wrong: formatting every
    # node's place took 4x json.loads' own time on a 4 MB manifest (qwen3-235b-a22b's)
    if _deeper_than(value, max_depth) or _may_hold_lone_surrogates(raw):
        check(value, what=what, max_depth=max_depth)
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# an escape, or a surrogate's 3-byte UTF-8 form (json.loads decodes bytes with surrogatepass)
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _may_hold_lone_surrogates(raw: str | bytes) -> bool:
    """False only where no string parsed from `raw` can hold a surrogate (paired or not): a str that
    encodes to UTF-8 and a UTF-8 document, each without a surrogate's escape or encoding."""
    if isinstance(raw, str):
        try:
            raw.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return "\\u" in raw and _SURROGATE_ESCAPE.search(raw) is not None  # the scan only past a cheap find
    raw = bytes(raw)
    if json.detect_encoding(raw) != "utf-8":  # UTF-16/32 or a BOM: the walk decides
        return True
    return (b"\\u" in raw or b"\xed" in raw) and _SURROGATE_BYTES.search(raw) is not None


def _deeper_than(value: Any, max_depth: int) -> bool:
    """Whether a container lies `max_depth` or more levels below the top (check's bound, unnamed)."""
    level = [value] if type(value) in _CONTAINERS else []
    for _ in range(max_depth):
        if not level:
            return False
        level = [
            child
            for item in level
            for child in (item.values() if type(item) is dict else item)
            if type(child) in _CONTAINERS
        ]
    return bool(level)


def check(value: Any, *, what: str, max_depth: int = MAX_DEPTH) -> None:
    """Walk a parsed document (without recursion) and enforce loads' bounds on it."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item, what, where)
            continue
        if not isinstance(item, dict | list):
            continue
        if depth >= max_depth:
            at = where if len(where) <= 60 else "..." + where[-57:]
            raise JSONLimitError(f"{what}: nested more than {max_depth} levels deep (at {at or 'the top'})")
        if isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, what, where)
                stack.append((child, f"{where}.{_short(key)}" if where else _short(key), depth + 1))
        elif not _SCALARS.issuperset(map(type, item)):  # a list of numbers (token ids) has nothing to walk
            stack.extend((child, f"{where}[{i}]", depth + 1) for i, child in enumerate(item))


def _check_text(text: str, what: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        place = f" at {where}" if where else ""
        raise JSONLimitError(
            f"{what}: a string{place} holds a lone surrogate ({exc.object[exc.start]!a} at character {exc.start}), "
            "which is not text"
        ) from None


def _short(key: str) -> str:
    """A key as it appears in an error's path: bounded, and printable whatever it holds."""
    return clip(key, 40).encode("utf-8", "backslashreplace").decode("utf-8")
