"""qcompile.graph.ops (the contract as data) agrees with docs/OPS.md (the contract as prose)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qcompile.graph.ops import FUSED_OPS, SIGNATURES, SIMPLE_OPS, STANDARD_OPS

OPS_MD = Path(__file__).resolve().parents[2] / "docs" / "OPS.md"


def _sections() -> dict[str, str]:
    text = OPS_MD.read_text(encoding="utf-8")
    parts = re.split(r"^## ", text, flags=re.M)
    return {part.splitlines()[0].strip(): part for part in parts[1:]}


def _split_top(cell: str) -> list[str]:
    """Split a table cell on commas outside brackets and parentheses."""
    items, depth, current = [], 0, ""
    for ch in cell:
        depth += ch in "([" and 1 or 0
        depth -= ch in ")]" and 1 or 0
        if ch == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        items.append(current.strip())
    return items


def _table(section: str) -> dict[str, list[str]]:
    rows = {}
    for line in section.splitlines():
        match = re.match(r"^\| `(\w+)` \|(.*)\|\s*$", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split("|")]
    return rows


def _names(cell: str) -> list[str]:
    return [] if cell in ("—", "-", "") else [item.split()[0] for item in _split_top(cell)]


def test_standard_ops_match_the_doc() -> None:
    section = next(body for title, body in _sections().items() if title.startswith("Standard ops"))
    documented = {m.group(1) for m in re.finditer(r"`([A-Z][A-Za-z]+)[(`]", section)}
    assert documented == STANDARD_OPS


@pytest.mark.parametrize(("title", "ops"), [("simple", SIMPLE_OPS), ("fused", FUSED_OPS)])
def test_qcompile_ops_and_signatures_match_the_doc(title: str, ops: frozenset[str]) -> None:
    section = next(body for name, body in _sections().items() if name.startswith("`qcompile` ops") and title in name)
    table = _table(section)
    assert set(table) == ops
    for op, (inputs, outputs, attrs, *_) in table.items():
        sig = SIGNATURES[op]
        assert _names(inputs) == [name.rstrip("?") for name, _ in sig.inputs], op
        optional = [item.split()[0] for item in _split_top(inputs) if "(optional" in item]
        assert optional == [name.rstrip("?") for name, _ in sig.inputs if name.endswith("?")], op
        if outputs.startswith("same"):  # "same as x": one unnamed output
            assert len(sig.outputs) == 1, op
        else:
            assert _names(outputs) == [name for name, _ in sig.outputs], op
        assert set(_names(attrs)) == set(sig.attrs), op
