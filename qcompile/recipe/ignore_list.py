"""quantization.ignore as llm-compressor reads it, matched with bounded work whatever the patterns.

An entry is an exact module name, or `re:` + a regex that compressed-tensors applies with Python's
`re.match` (anchored at the start of the name, not at its end); we keep exactly that meaning. `re`
cannot be stopped once it runs, and a pattern such as `(.|.)*\\d$` backtracks for hours on a 40-character
module name. So each pattern is checked with `re` (what the exported checkpoint's readers accept), then
compiled once with the `regex` package, which reads every pattern that passes these checks as `re` does
and takes a timeout: each name gets MATCH_SECONDS, all names together BUDGET_SECONDS. Where the two
packages would read a pattern differently (a `{` that is not a repeat count: fuzzy matching in
`regex`; `[` in a set: a nested set or POSIX class there), the pattern is refused. Its length, nesting and
unrolled size are bounded first, because compiling is work too (`regex` unrolls counted repeats).
"""

from __future__ import annotations

import re
import time
import warnings
from re import _constants as sre
from re import _parser  # the stdlib's own parser (private, stable since 2.x): reads a pattern, unrolls nothing

import regex
from qruntime.shown import shown

from qcompile.errors import RecipeError

MAX_PATTERNS = 256  # `re:` entries in one list
MAX_PATTERN_CHARS = 1024  # of one pattern (module names are under 100 characters)
MAX_DEPTH = 32  # nested groups; `re` and `regex` recurse per level and overflow Python's stack near 400
MAX_UNROLLED = 100_000  # items once counted repeats are unrolled, all patterns together (~0.1 s to compile)
MATCH_SECONDS = 0.05  # one pattern against one name: microseconds when the pattern is sane
BUDGET_SECONDS = 5.0  # every pattern against every name of the model, together
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT)
_COUNT = re.compile(r"\{\d*(?:,\d*)?\}")  # a repeat count as `re` reads one; any other `{` is literal there


class IgnoreList:
    """The entries of quantization.ignore, compiled once; `matches(name)` says whether one keeps the module
    `name` unquantized, or raises RecipeError where a pattern takes too long. The time budget belongs to
    this object, which a recipe holds: a compile loads its recipe afresh."""

    def __init__(
        self,
        entries: tuple[str, ...],
        key: str = "quantization.ignore",
        match_seconds: float = MATCH_SECONDS,
        budget_seconds: float = BUDGET_SECONDS,
    ) -> None:
        patterns = [e for e in entries if e.startswith("re:")]
        if len(patterns) > MAX_PATTERNS:
            raise RecipeError(f"{key} holds {len(patterns)} 're:' patterns; the limit is {MAX_PATTERNS}")
        self.key = key
        self.match_seconds = match_seconds
        self.budget_seconds = budget_seconds
        self.seconds_left = budget_seconds
        compiled: dict[str, regex.Pattern] = {}
        unrolled = 0
        for entry in dict.fromkeys(patterns):
            compiled[entry], size = _compile(entry, key)
            unrolled += size
            if unrolled > MAX_UNROLLED:
                raise RecipeError(
                    f"{key} entry {shown(entry)}: the patterns' counted repeats unroll to more than "
                    f"{MAX_UNROLLED:,} items; use * or + instead of large {{m,n}} counts"
                )
        self._entries = tuple((e, compiled.get(e)) for e in entries)  # in order: the first match decides

    def matches(self, name: str) -> bool:
        """Whether an entry matches module `name`: equal to it, or a pattern `re.match`es it."""
        return any(
            name == entry if pattern is None else self._match(entry, pattern, name) for entry, pattern in self._entries
        )

    def _match(self, entry: str, pattern: regex.Pattern, name: str) -> bool:
        timeout = min(self.match_seconds, self.seconds_left)
        if timeout <= 0:  # `regex` reads a timeout of 0 as "time out now", a negative one as "never"
            raise self._too_long(entry, name, timeout)
        start = time.perf_counter()
        try:
            return pattern.match(name, timeout=timeout) is not None
        except TimeoutError:
            raise self._too_long(entry, name, timeout) from None
        finally:
            self.seconds_left -= time.perf_counter() - start

    def _too_long(self, entry: str, name: str, timeout: float) -> RecipeError:
        if timeout < self.match_seconds:
            return RecipeError(
                f"{self.key}: matching its patterns against the model's module names took more than "
                f"{self.budget_seconds:g} s in all (at {shown(entry)} and {shown(name)}): simplify them"
            )
        return RecipeError(
            f"{self.key} entry {shown(entry)} took more than {timeout:g} s to match {shown(name)}: simplify it"
        )


def _compile(entry: str, key: str) -> tuple[regex.Pattern, int]:
    """`entry`'s pattern compiled with `regex` once it is shown to mean there what it means to `re`, and
    its unrolled size."""
    body = entry.removeprefix("re:")
    where = f"{key} entry {shown(entry)}"
    if len(body) > MAX_PATTERN_CHARS:
        raise RecipeError(f"{where}: {len(body):,} characters; a pattern may be at most {MAX_PATTERN_CHARS:,}")
    depth, differs = _scan(body)
    if depth > MAX_DEPTH:
        raise RecipeError(f"{where}: groups nested more than {MAX_DEPTH} deep")
    try:
        with warnings.catch_warnings():  # "possible nested set": refused below, with the reason
            warnings.simplefilter("ignore", FutureWarning)
            re.compile(body)  # what compressed-tensors, vLLM and SGLang will match the exported list with
            tree = _parser.parse(body)
    except (re.error, RecursionError) as exc:
        raise RecipeError(f"{where} is not a valid regex ({exc})") from exc
    if differs:
        raise RecipeError(f"{where}: {differs}")
    size = _unrolled(tree)
    if size > MAX_UNROLLED:
        raise RecipeError(
            f"{where}: its counted repeats unroll to {size:,} items, over {MAX_UNROLLED:,}; "
            "use * or + instead of large {m,n} counts"
        )
    try:
        return regex.compile(body, regex.VERSION0), size
    except regex.error as exc:  # pragma: no cover - `re` accepted it, and `regex` reads a superset
        raise RecipeError(f"{where} is not a valid regex ({exc})") from exc


def _scan(body: str) -> tuple[int, str | None]:
    """How deep `body`'s groups nest, and where `regex` would read it otherwise than `re` (or None).
    Cheap and lenient: `re` reports malformed patterns."""
    depth = deepest = i = 0
    while i < len(body):
        char = body[i]
        if char == "\\":
            i += 2
            continue
        if char == "[":  # a set: `]` right after `[` or `[^` is a member; escapes and `[` inside
            start, negated = i, body.startswith("[^", i)
            i += 2 if negated else 1
            i += body.startswith("]", i)
            classes: set[str] = set()
            while i < len(body) and body[i] != "]":
                if body[i] == "[":
                    return deepest, (
                        f"'[' inside a set at position {i} (Python's re reads a literal '[', the regex package "
                        r"a nested set or a POSIX class such as [:digit:]): escape it as \[, or write the class out"
                    )
                if body[i] == "\\":
                    classes.add(body[i + 1 : i + 2])
                i += 2 if body[i] == "\\" else 1
            pair = next((c + c.upper() for c in "dws" if {c, c.upper()} <= classes), None)
            if negated and pair:
                return deepest, (
                    f"the set at position {start} excludes both \\{pair[0]} and \\{pair[1]}, so no character "
                    "under Python's re, some under the regex package: remove it"
                )
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth -= 1
        elif char == "{" and not _COUNT.match(body, i):
            return deepest, (
                f"'{{' at position {i} is not a repeat count {{m,n}} (the regex package reads fuzzy matching "
                r"there, Python's re a literal '{'): escape it as \{"
            )
        i += 1
    return deepest, None


def _unrolled(items: _parser.SubPattern | list) -> int:
    """Items in `items` once every counted repeat is written out (the larger count where it is finite)."""
    total = 0
    for op, av in items:
        if op in _REPEATS:
            low, high, sub = av
            total += _unrolled(sub) * max(1, low if high == sre.MAXREPEAT else high)
        elif op is sre.SUBPATTERN:
            total += _unrolled(av[3])
        elif op is sre.BRANCH:
            total += sum(_unrolled(branch) for branch in av[1])
        elif op in (sre.ASSERT, sre.ASSERT_NOT):
            total += _unrolled(av[1])
        elif op is sre.ATOMIC_GROUP:
            total += _unrolled(av)
        elif op is sre.GROUPREF_EXISTS:
            total += _unrolled(av[1]) + (_unrolled(av[2]) if av[2] else 0)
        else:
            total += 1
    return total
