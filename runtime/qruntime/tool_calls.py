"""Qwen3's tool calls, told apart from the rest of its answer.

Qwen3 (as Hermes-format models) writes each call as a JSON object in its own block:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- The answer's text before the first `<tool_call>` is its content (None when only whitespace); the
  calls follow, in order (several are parallel calls).
- A block must hold a JSON object with a string `name` and an object `arguments` (a JSON string of
  an object is taken too); `arguments` comes back as JSON text, as OpenAI's API carries it.
- If any block is not such an object, or a block is never closed (cut short by max_tokens), the
  whole answer is content and there are no calls (as vLLM's Hermes parser does).

`ToolCallStreamer` does it as text streams in: content passes until what could be the start of a
`<tool_call>`; each call comes out once its block closes; `finish()` gives back as content what
was held if a block turned out not to be a call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from qruntime.reasoning import tag_prefix_len

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


def _call(block: str) -> ToolCall | None:
    """The call a block's JSON names, None when it is not one."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str | None, tuple[ToolCall, ...]]:
    """(content, calls) of a whole answer (see the module docstring)."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, ()
    calls, at = [], start
    while at >= 0:
        end = text.find(CALL_CLOSE, at)
        if end < 0:
            return text, ()
        call = _call(text[at + len(CALL_OPEN) : end])
        if call is None:
            return text, ()
        calls.append(call)
        rest = end + len(CALL_CLOSE)
        at = text.find(CALL_OPEN, rest)
        if at < 0 and text[rest:].strip():  # text after the last call: kept as content, as the calls
            return text, ()
        if at >= 0 and text[rest:at].strip():
            return text, ()
    content = text[:start]
    return (content if content.strip() else None), tuple(calls)


class ToolCallStreamer:
    """One answer's text, split as it arrives: `feed(delta)` -> (content now, calls completed now);
    `finish()` -> (content held back, calls) at the end. For an answer parse_tool_calls takes as
    calls, the pieces join to its result. A stream cannot take back what it sent: where the whole
    text would be all content (a broken or unclosed block, text after the calls), the calls before
    that point have gone out, and the rest comes out as content from finish()."""

    def __init__(self) -> None:
        self._held = ""  # text that may still be (part of) a call
        self._in_calls = False  # a <tool_call> has been seen
        self._calls: list[ToolCall] = []

    @property
    def called(self) -> bool:
        return bool(self._calls)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        held = self._held + text
        self._held = ""
        if not self._in_calls:
            start = held.find(CALL_OPEN)
            if start < 0:
                keep = tag_prefix_len(held, CALL_OPEN)
                self._held = held[len(held) - keep :]
                return held[: len(held) - keep], []
            self._in_calls = True
            content, held = held[:start], held[start:]
        else:
            content = ""
        done = []
        while True:
            end = held.find(CALL_CLOSE)
            if end < 0:
                break
            opened = held.find(CALL_OPEN)
            call = _call(held[opened + len(CALL_OPEN) : end]) if opened >= 0 and not held[:opened].strip() else None
            if call is None:  # not a call: everything from here on is content (finish gives it back)
                self._calls += done
                self._held = held
                return content, done
            done.append(call)
            held = held[end + len(CALL_CLOSE) :]
        self._calls += done
        self._held = held
        return content, done

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left: text held back comes out as content (an unclosed or broken block)."""
        held, self._held = self._held, ""
        if self._in_calls and not held.strip():
            return "", []
        return held, []
