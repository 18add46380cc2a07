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
`<tool_call>`; a call's name comes out as soon as its block reads `{"name": "...", "arguments": {`
(the order Qwen3's template asks for), then its arguments' text as it arrives (as vLLM's Hermes
parser streams them: the model's own JSON text, which the client joins); a block written otherwise
(another key order, arguments as a JSON string) comes out whole when it closes. `finish()` gives
back as content what was held if a block turned out not to be a call — a stream cannot take back a
name or arguments it sent for a block that then breaks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from qruntime.reasoning import tag_prefix_len

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# a block's start, up to its arguments' value: streamed from here when that value is an object
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


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


@dataclass(frozen=True)
class CallDelta:
    """A piece of a streamed call: `call` is its number in the answer (0, 1, ...); a call's first
    piece carries its name (and arguments "" or their first characters), later ones more arguments."""

    call: int
    arguments: str
    name: str | None = None


@dataclass
class _Block:
    """How far the block being read has been streamed."""

    name: str | None = None  # sent
    start: int = 0  # where the arguments' value begins in the block
    at: int = 0  # arguments sent up to here
    depth: int = 0  # the JSON scanner over the arguments: nesting, inside a string, after a backslash
    in_string: bool = False
    escaped: bool = False
    done: bool = False  # the arguments' object has closed


class ToolCallStreamer:
    """One answer's text, split as it arrives: `feed(delta)` -> (content now, call pieces now);
    `finish()` -> (content held back, pieces) at the end. For an answer parse_tool_calls takes as
    calls, each call's pieces join to its name and arguments (the model's JSON text of them; the
    same object as parse_tool_calls' normalised text). A stream cannot take back what it sent: where
    the whole text would be all content (a broken or unclosed block, text after the calls), what was
    sent before that point has gone out, and the rest comes out as content from finish()."""

    def __init__(self) -> None:
        self._held = ""  # text that may still be (part of) a call
        self._in_calls = False  # a <tool_call> has been seen
        self._count = 0  # calls completed
        self._block = _Block()
        self._broken = False

    @property
    def called(self) -> bool:
        return self._count > 0

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        held = self._held + text
        self._held = ""
        if self._broken:
            self._held = held
            return "", []
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
        out: list[CallDelta] = []
        while True:
            opened = held.find(CALL_OPEN)
            if opened < 0 or held[:opened].strip():
                break  # no block yet, or text between calls (it breaks them: finish gives it back)
            end = held.find(CALL_CLOSE, opened)
            body = held[opened + len(CALL_OPEN) : end if end >= 0 else len(held)]
            out += self._advance(body)
            if end < 0:
                break
            call = _call(body)
            if call is None:  # not a call: everything from here on is content
                self._broken = True
                break
            block, self._block = self._block, _Block()
            if block.name is None:
                out.append(CallDelta(self._count, call.arguments, call.name))
            elif not block.done:  # named, but its arguments were not an object streamed to its end
                out.append(CallDelta(self._count, call.arguments[block.at - block.start :]))
            self._count += 1
            held = held[end + len(CALL_CLOSE) :]
        self._held = held
        return content, out

    def _advance(self, body: str) -> list[CallDelta]:
        """The pieces of the open block's call that `body` (its text so far) adds."""
        block, out = self._block, []
        if block.name is None:
            head = HEAD.match(body)
            if head is None or head.end() >= len(body) or body[head.end()] != "{":
                return out  # not (yet) the streamable form: the call comes whole at its close
            name = json.loads(head.group(1))
            if not isinstance(name, str) or not name:
                return out
            block.name, block.start = name, head.end()
            block.at = head.end()
            out.append(CallDelta(self._count, "", name))
        if block.done:
            return out
        i = block.at
        while i < len(body):  # the arguments object, scanned as JSON up to its closing brace
            ch = body[i]
            i += 1
            if block.in_string:
                if block.escaped:
                    block.escaped = False
                elif ch == "\\":
                    block.escaped = True
                elif ch == '"':
                    block.in_string = False
            elif ch == '"':
                block.in_string = True
            elif ch in "{[":
                block.depth += 1
            elif ch in "}]":
                block.depth -= 1
                if block.depth == 0:
                    block.done = True
                    break
        if i > block.at:
            out.append(CallDelta(self._count, body[block.at : i]))
            block.at = i
        return out

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What is left: text held back comes out as content (an unclosed or broken block)."""
        held, self._held = self._held, ""
        if self._in_calls and not held.strip():
            return "", []
        return held, []
