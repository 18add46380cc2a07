"""Qwen3's thinking, told apart from its answer: the reply's `<think>…</think>` block is the
reasoning, what follows the answer (as vLLM's qwen3 reasoning parser returns them, as
`reasoning_content` and `content`).

- A reply that opens with `<think>` (after any whitespace) reasons until `</think>`; the newlines
  right after `</think>` are dropped from the answer.
- When the prompt itself ends in an open `<think>` (the chat templates of Qwen3's thinking-only
  releases put it there), the reply starts in the block.
- A reply that does not open the block is all answer: with `enable_thinking: false` Qwen3's template
  writes an empty block into the prompt.
- A block the reply never closes (cut short by max_tokens) is all reasoning.

`ReasoningSplitter` does it as text streams in, holding back only what could still be the start of
a tag, so the streamed pieces join to what `split_reasoning` gives for the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class Split:
    reasoning: str
    content: str


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an open thinking block."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


def tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (may become the tag):
    what a streamed parser holds back (tool_calls uses it too)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """One reply's text, split as it arrives: `feed(delta)` -> what is decided now, `flush()` at the end."""

    def __init__(self, opened: bool = False) -> None:
        # "start": not yet known whether the reply opens a block; "reasoning"; "answer_start": just
        # after </think>, dropping newlines; "answer"
        self._state = "reasoning" if opened else "start"
        self._held = ""

    def feed(self, text: str) -> Split:
        held = self._held + text
        self._held = ""
        reasoning = content = ""
        while held:
            if self._state == "start":
                stripped = held.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._state, held = "reasoning", stripped[len(THINK_OPEN) :]
                elif THINK_OPEN.startswith(stripped):  # whitespace, or part of the tag: wait for more
                    self._held = held
                    break
                else:
                    self._state = "answer"
            elif self._state == "reasoning":
                end = held.find(THINK_CLOSE)
                if end < 0:
                    keep = tag_prefix_len(held, THINK_CLOSE)
                    reasoning += held[: len(held) - keep]
                    self._held = held[len(held) - keep :]
                    break
                reasoning += held[:end]
                self._state, held = "answer_start", held[end + len(THINK_CLOSE) :]
            elif self._state == "answer_start":
                held = held.lstrip("\n")
                if held:
                    self._state = "answer"
            else:
                content += held
                held = ""
        return Split(reasoning, content)

    def flush(self) -> Split:
        """What is still held: a tag's start that never completed is text of the state it was in."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return Split(held, "")
        if self._state == "start":
            return Split("", held)
        return Split("", "")


def split_reasoning(text: str, opened: bool = False) -> Split:
    """The whole reply's reasoning and answer."""
    splitter = ReasoningSplitter(opened)
    first, last = splitter.feed(text), splitter.flush()
    return Split(first.reasoning + last.reasoning, first.content + last.content)
