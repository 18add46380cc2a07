"""YAML from someone else's bytes (a recipe, a `--set` value, a model card's front matter), with bounds.

`yaml.safe_load` builds no arbitrary objects, but it still expands aliases (a "billion laughs" document
of a few hundred bytes becomes billions of list items), composes nested nodes by recursion (deep
nesting ends in RecursionError) and reads whatever size it is given. `loads` refuses anchors and
aliases outright (no recipe needs them), bounds the nesting depth and the text's length, and raises
`YAMLLimitError` — a yaml.YAMLError, which the callers already report — naming the document.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_DEPTH = 32  # mappings/sequences inside each other; an llm-compressor recipe needs 5
MAX_CHARS = 64 << 10  # the shipped recipes are under 1 kB; PyYAML composes ~30k list items a second
# in pure Python (its C loader cannot refuse aliases as it composes), so this keeps any document ~2 s


class YAMLLimitError(yaml.YAMLError):
    """The document is past a bound: an anchor or alias, nesting too deep, or too long."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses anchors/aliases and counts the nesting depth as it composes."""

    def __init__(self, stream: str, what: str, max_depth: int) -> None:
        super().__init__(stream)
        self.what = what
        self.max_depth = max_depth
        self.depth = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            mark = event.start_mark
            raise YAMLLimitError(
                f"{self.what}: line {mark.line + 1}: YAML anchors and aliases (&name, *name) are not "
                "allowed; write the value out where it is used"
            )
        if not isinstance(event, yaml.SequenceStartEvent | yaml.MappingStartEvent):
            return super().compose_node(parent, index)
        if self.depth >= self.max_depth:
            mark = event.start_mark
            raise YAMLLimitError(f"{self.what}: line {mark.line + 1}: nested more than {self.max_depth} levels deep")
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def loads(text: str, *, what: str, max_depth: int = MAX_DEPTH, max_chars: int = MAX_CHARS) -> Any:
    """Parse one YAML document from `text`; `what` names it in errors.

    Raises YAMLLimitError past a bound and yaml.YAMLError for malformed YAML (also for a scalar
    Python cannot convert, such as an integer of more than 4,300 digits)."""
    if len(text) > max_chars:
        raise YAMLLimitError(f"{what}: {len(text):,} characters of YAML; the limit is {max_chars:,}")
    loader = _BoundedLoader(text, what, max_depth)
    try:
        return loader.get_single_data()
    except ValueError as exc:  # int("9" * 5000) and the like, raised while constructing a scalar
        raise yaml.YAMLError(f"{what}: a value cannot be read ({exc})") from None
    except RecursionError:  # the scanner/parser, should their own recursion ever run out first
        raise YAMLLimitError(f"{what}: nested too deeply") from None
    finally:
        loader.dispose()
