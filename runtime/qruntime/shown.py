"""Someone else's values as error messages echo them: bounded in length and in the cost of making
them, whatever they are (a 10 MB string, a list nested 10,000 deep, an integer of 10,000 digits)."""

from __future__ import annotations

import reprlib

SHOWN_CHARS = 60  # the most characters of a user's value an error message echoes


def clip(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` cut to `limit` characters (the last three "..." when cut)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`value`'s repr cut to `limit` characters, made at a bounded cost."""
    return clip(_BoundedRepr(limit).repr(value), limit)


class _BoundedRepr(reprlib.Repr):
    """reprlib's bounded repr (a few items of each container, a few levels deep), with integers
    too long for `repr` (Python refuses over 4,300 digits) shown by their size."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxstring = self.maxother = self.maxlong = limit
        self.maxlevel = 3

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 4 * self.maxlong:
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)

    def repr_instance(self, x: object, level: int) -> str:
        try:
            return super().repr_instance(x, level)
        except (ValueError, RecursionError):
            return f"<{type(x).__name__}>"
