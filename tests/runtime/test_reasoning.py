"""Qwen3's <think> block told apart from the answer: whole and streamed alike, whatever the pieces
the text arrives in (tags split anywhere), as vLLM's qwen3 reasoning parser splits it."""

from __future__ import annotations

import random

import pytest
from qruntime.reasoning import ReasoningSplitter, Split, prompt_opens_thinking, split_reasoning

ALPHABET = "ab <>/thinké\n日"  # tag characters too, so near-tags occur in the text


def _text(rng: random.Random, most: int = 40) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(most))).replace("</think>", "")


def _streamed(text: str, rng: random.Random, opened: bool) -> Split:
    splitter, reasoning, content, i = ReasoningSplitter(opened), [], [], 0
    while i < len(text):
        n = rng.randrange(1, 6)
        piece = splitter.feed(text[i : i + n])
        reasoning.append(piece.reasoning)
        content.append(piece.content)
        i += n
    last = splitter.flush()
    return Split("".join(reasoning) + last.reasoning, "".join(content) + last.content)


def test_a_thinking_reply_in_any_pieces(rng):
    for _ in range(300):
        reasoning, answer = _text(rng), _text(rng).lstrip("\n")
        lead = rng.choice(["", "\n", "  \n"])
        text = f"{lead}<think>{reasoning}</think>{rng.choice(['', chr(10), chr(10) * 2])}{answer}"
        expected = Split(reasoning, answer)
        assert split_reasoning(text) == expected, text
        assert _streamed(text, rng, opened=False) == expected, text


def test_a_block_the_prompt_opened(rng):
    for _ in range(200):
        reasoning, answer = _text(rng), _text(rng).lstrip("\n")
        text = f"{reasoning}</think>\n\n{answer}"
        assert split_reasoning(text, opened=True) == _streamed(text, rng, opened=True) == Split(reasoning, answer)


def test_replies_without_a_block_are_all_answer(rng):
    for _ in range(200):
        text = _text(rng)
        if text.lstrip().startswith("<think>"):
            continue
        assert split_reasoning(text) == _streamed(text, rng, opened=False) == Split("", text), repr(text)


@pytest.mark.parametrize(
    ("text", "opened", "reasoning", "content"),
    [
        ("<think>cut short", False, "cut short", ""),  # max_tokens inside the block: all reasoning
        ("<thi", False, "", "<thi"),  # the reply ended on part of a tag: it was text
        ("cut </thi", True, "cut </thi", ""),
        ("<think></think>answer", False, "", "answer"),
        ("x<think>y</think>z", False, "", "x<think>y</think>z"),  # a block not at the start is text
        ("</think>\n\nanswer", True, "", "answer"),
    ],
)
def test_edges(text, opened, reasoning, content, rng):
    assert split_reasoning(text, opened) == _streamed(text, rng, opened) == Split(reasoning, content)


def test_prompts_that_open_the_block():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
