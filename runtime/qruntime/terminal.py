"""Generated text shown on a terminal: the characters a terminal would act on instead of showing are
written as escapes, so a model's output cannot move the cursor, clear the screen, retitle the window
or reorder what follows (bidi overrides). Pipes and --json keep the text as it is."""

from __future__ import annotations

import unicodedata

KEPT = frozenset("\n\t")
ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs"})  # controls (C0, DEL, C1), format (bidi, zero-width), surrogates


def escaped(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def for_terminal(text: str) -> str:
    """`text` with its control, format and surrogate characters (newline and tab aside) as escapes:
    ESC -> \\x1b, U+202E -> \\u202e."""
    if text.isprintable():  # the usual case, in C: nothing to do
        return text
    return "".join(
        escaped(ch) if ch not in KEPT and unicodedata.category(ch) in ESCAPED_CATEGORIES else ch for ch in text
    )
