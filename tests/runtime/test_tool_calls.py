"""Qwen3's <tool_call> blocks told apart from an answer (qruntime.tool_calls), whole and streamed in
random pieces, and the synthesized checkpoints' chat template rendering tools, calls and results."""

from __future__ import annotations

import json

import pytest
from qruntime.tokenizer import Tokenizer
from qruntime.tool_calls import CALL_CLOSE, CALL_OPEN, ToolCall, ToolCallStreamer, parse_tool_calls

WORDS = ("weather", "in", "Paris", "let", "me", "check", "é", "日本", "{", "}", '"', "<", "tool")


def _arguments(rng) -> dict:
    values = [rng.randrange(-100, 100), rng.random(), rng.choice(WORDS), None, True, [1, "x"], {"deep": {"k": "v"}}]
    return {f"a{i}": rng.choice(values) for i in range(rng.randrange(0, 4))}


def _reply(rng, calls: int) -> tuple[str, str | None, list[ToolCall]]:
    """A reply of some content then `calls` well-formed calls: (text, content, the calls)."""
    content = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(0, 6)))
    made, text = [], content + rng.choice(["", "\n", "\n\n"])
    for k in range(calls):
        name, arguments = f"fn_{rng.randrange(100)}", _arguments(rng)
        made.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        shown_args = (
            json.dumps(json.dumps(arguments)) if rng.random() < 0.2 else json.dumps(arguments)
        )  # a JSON string too
        text += ("\n" if k else "") + f'{CALL_OPEN}\n{{"name": "{name}", "arguments": {shown_args}}}\n{CALL_CLOSE}'
    text += rng.choice(["", "\n"])
    want = content + text[len(content) : text.find(CALL_OPEN)] if calls else text
    return text, (want if want.strip() else None) if calls else text, made


def _streamed(text: str, rng, pieces: list | None = None) -> tuple[str, list[ToolCall]]:
    """Feed `text` in random steps; (content, the calls its pieces join to, arguments normalised)."""
    streamer, content, got, at = ToolCallStreamer(), "", [], 0
    while at < len(text):
        step = rng.randrange(1, 8)
        piece, made = streamer.feed(text[at : at + step])
        content, got, at = content + piece, got + made, at + step
    rest, made = streamer.finish()
    got += made
    if pieces is not None:
        pieces += got
    calls: dict[int, list[str]] = {}
    for p in got:
        assert (p.name is not None) == (p.call not in calls), p  # the name first, once
        calls.setdefault(p.call, [p.name, ""])[1] += p.arguments
    assert sorted(calls) == list(range(len(calls)))
    joined = [ToolCall(n, json.dumps(json.loads(a), ensure_ascii=False)) for n, a in calls.values()]
    return content + rest, joined


@pytest.mark.parametrize("calls", [0, 1, 3])
def test_calls_come_apart_from_the_content_whole_and_streamed(rng, calls):
    for _ in range(20):
        text, content, made = _reply(rng, calls)
        assert parse_tool_calls(text) == (content, tuple(made)), text
        streamed_content, streamed_calls = _streamed(text, rng)
        assert streamed_calls == made
        # a stream sends the whitespace before a call as it comes; the whole answer calls it no content
        assert (streamed_content if streamed_content.strip() or not calls else None) == content


@pytest.mark.parametrize(
    "block",
    [
        "{not json}",
        '{"arguments": {}}',  # no name
        '{"name": "", "arguments": {}}',
        '{"name": "f", "arguments": [1, 2]}',  # arguments not an object
        '{"name": "f", "arguments": "not json"}',
        '["f", {}]',
    ],
)
def test_a_block_that_is_not_a_call_leaves_the_answer_all_content(rng, block):
    text = f"Sure.\n{CALL_OPEN}\n{block}\n{CALL_CLOSE}"
    assert parse_tool_calls(text) == (text, ())
    content, calls = _streamed(text, rng)
    assert calls == [] and content == text


def test_arguments_stream_as_they_arrive(rng):
    """A call written as Qwen3's template asks ({"name": ..., "arguments": {...}}) sends its name as
    soon as its arguments begin, then their text piece by piece; another key order comes whole."""
    arguments = {"city": 'Pa"ris {x}', "days": [1, {"n": [2, 3]}], "note": "\\"}
    text = f'Sure. {CALL_OPEN}\n{{"name": "get_weather", "arguments": {json.dumps(arguments)}}}\n{CALL_CLOSE}'
    text += f'{CALL_OPEN}{{"arguments": {{"a": 1}}, "name": "later"}}{CALL_CLOSE}'
    pieces: list = []
    content, calls = _streamed(text, rng, pieces)
    assert content == "Sure. " and calls == [
        ToolCall("get_weather", json.dumps(arguments, ensure_ascii=False)),
        ToolCall("later", '{"a": 1}'),
    ]
    first = [p for p in pieces if p.call == 0]
    assert first[0].name == "get_weather" and len(first) > 5  # streamed, not sent at the close
    assert "".join(p.arguments for p in first) == json.dumps(arguments)  # the model's own text
    assert [p for p in pieces if p.call == 1] == [pieces[-1]] and pieces[-1].name == "later"


def test_an_unclosed_block_or_text_after_the_calls_is_content(rng):
    good = f'{CALL_OPEN}\n{{"name": "f", "arguments": {{"x": 1}}}}\n{CALL_CLOSE}'
    for text in (f'Hi {CALL_OPEN}\n{{"name": "f"', f"{good}\nand then some words", f"{good} words {good}"):
        assert parse_tool_calls(text) == (text, ())
    content, calls = _streamed(f"{good}\nand then some words", rng)
    assert calls == [ToolCall("f", '{"x": 1}')] and content.strip() == "and then some words"


def test_the_template_renders_tools_calls_and_grouped_results(tiny_ckpt):
    tokenizer = Tokenizer.from_dir(tiny_ckpt)
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    assert tokenizer.apply_chat_template(plain, add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    assert text.count("<|im_start|>system") == 1  # the system message joins the tools' turn
    calls = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    calls += '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{calls}<|im_end|>\n" in text
    # what the assistant wrote parses back into the calls it made
    assert parse_tool_calls(calls) == (
        None,
        (ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_weather", '{"city": "Rome"}')),
    )
    results = "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>\n"
    assert text.endswith(results + "<|im_start|>assistant\n")
