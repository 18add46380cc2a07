"""Generated text shown on a terminal: controls, format characters and surrogates become escapes;
newlines, tabs and every other character (any script, emoji, U+FFFD) stay as they are."""

from __future__ import annotations

import unicodedata

from qruntime.terminal import for_terminal

PRINTABLE = "aZ09 .,;!?éß日本語😀👍🏽\ufffd—"
HOSTILE = "\x1b\x07\x00\x08\r\x7f\x85\x9b\u202e\u2066\u200b\ufeff\ud800"


def test_hostile_characters_become_escapes_and_the_rest_stays(rng):
    pieces = [rng.choice(PRINTABLE + HOSTILE + "\n\t") for _ in range(rng.randrange(20, 200))]
    text = "".join(pieces)
    shown = for_terminal(text)
    kept = [ch for ch in shown if ch not in "\n\t"]
    assert not any(unicodedata.category(ch) in ("Cc", "Cf", "Cs") for ch in kept), repr(shown)
    expected = "".join(
        ch if ch in PRINTABLE or ch in "\n\t" else ch.encode("unicode_escape", "backslashreplace").decode()
        if ord(ch) >= 0x100 else f"\\x{ord(ch):02x}"
        for ch in pieces
    )
    assert shown == expected


def test_escapes_of_each_width():
    assert for_terminal("a\x1b[2Jb") == "a\\x1b[2Jb"  # clear-screen, shown not done
    assert for_terminal("x\u202ey") == "x\\u202ey"
    assert for_terminal("line\n\tnext") == "line\n\tnext"
    assert for_terminal("日本\U000e0001") == "日本\\U000e0001"  # a language tag: a format character past the BMP
