"""Chat tools through the official `openai` client: the tools rendered into the prompt by the
artifact's template, a reply's <tool_call> blocks returned as tool_calls (finish_reason
"tool_calls"), whole and streamed, parallel calls, a multi-turn conversation with the tools'
results, and the tool_choice values. A random-weight model does not call tools, so the engine's
generated ids are swapped for a scripted reply's (ScriptedReplies): the server makes the text from
those ids, as it does from any model's."""

from __future__ import annotations

import dataclasses
import json

import openai
import pytest
import qruntime
from qruntime.serve.app import build_app
from serve_harness import CPU_LOAD, ThreadedServer

MODEL = "tiny-tools"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


class ScriptedReplies:
    """The real engine, each request's generated ids replaced by those of `reply` (settable; None:
    the model's own)."""

    def __init__(self, engine, reply: str) -> None:
        self._engine, self._sent, self._at = engine, {}, {}  # request id -> its scripted ids, the ones sent
        self.reply = reply

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _ids(self) -> tuple[int, ...]:
        return tuple(self._engine.tokenizer.encode(self.reply, add_special_tokens=False))

    def add_request(self, prompt, params=None, request_id=None, *, detokenize=True):
        if self.reply is None:  # the model's own reply
            return self._engine.add_request(prompt, params, request_id, detokenize=detokenize)
        ids = self._ids()
        params = dataclasses.replace(params, max_tokens=len(ids), ignore_eos=True, stop=(), stop_token_ids=())
        rid = self._engine.add_request(prompt, params, request_id, detokenize=detokenize)
        self._sent[rid] = ids
        return rid

    def step(self):
        out = []
        for delta in self._engine.step():
            if delta.request_id not in self._sent:
                out.append(delta)
                continue
            ids, at = self._sent[delta.request_id], self._at.get(delta.request_id, 0)
            self._at[delta.request_id] = at + len(delta.token_ids)
            output = delta.output
            if output is not None:
                output = dataclasses.replace(output, token_ids=ids[: len(output.token_ids)], finish_reason="stop")
            out.append(dataclasses.replace(delta, token_ids=ids[at : at + len(delta.token_ids)], output=output))
        return out


def _call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


@pytest.fixture(scope="module")
def scripted(tiny_ckpt, compiled):
    # the tools' schemas make a long prompt for the tiny vocabulary: more context than CPU_LOAD's
    engine = qruntime.load(compiled(tiny_ckpt, "ptpc-fp8"), **{**CPU_LOAD, "max_model_len": 1024, "num_kv_blocks": 256})
    return ScriptedReplies(engine, "")


@pytest.fixture(scope="module")
def client(scripted):
    with ThreadedServer(build_app(scripted, model_name=MODEL, max_waiting=16)) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _ask(client, **kwargs):
    messages = kwargs.pop("messages", [{"role": "user", "content": "What is the weather in Paris?"}])
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=0, **kwargs)


def test_a_reply_that_calls_tools_comes_back_as_tool_calls(client, scripted):
    scripted.reply = "Let me check.\n" + _call("get_weather", {"city": "Paris"}) + "\n" + _call("get_time", {})
    choice = _ask(client, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}),
        ("function", "get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    only = _ask(client, tools=TOOLS, parallel_tool_calls=False).choices[0].message.tool_calls
    assert [c.function.name for c in only] == ["get_weather"]


def _joined(chunks) -> list:
    """A stream's tool-call deltas joined per call, as a client does: (index, id, name, arguments text)."""
    calls: dict[int, list] = {}
    for chunk in chunks:
        for t in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if t.index not in calls:
                assert t.id and t.function.name, t  # a call's first delta names it
                calls[t.index] = [t.index, t.id, t.function.name, ""]
            else:
                assert t.id is None and t.function.name is None, t
            calls[t.index][3] += t.function.arguments or ""
    return list(calls.values())


def test_streamed_tool_calls_join_to_the_whole_ones(client, scripted):
    scripted.reply = _call("get_weather", {"city": "Rome", "unit": "C"}) + _call("get_time", {})
    chunks = list(_ask(client, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = _joined(chunks)
    assert [(index, name, json.loads(args)) for index, _, name, args in calls] == [
        (0, "get_weather", {"city": "Rome", "unit": "C"}),
        (1, "get_time", {}),
    ]
    pieces = [t for d in deltas for t in (d.tool_calls or []) if t.index == 0]
    assert len(pieces) > 2  # the arguments came as the model wrote them, not at the call's close
    assert "".join(d.content or "" for d in deltas).strip() == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@dataclasses.dataclass
class _Call:  # a joined streamed call, shaped as the client's whole ones (call.function.name / arguments)
    name: str
    arguments: str

    @property
    def function(self):
        return self


def test_a_reply_without_calls_is_content(client, scripted):
    scripted.reply = "It is sunny, I think."
    choice = _ask(client, tools=TOOLS).choices[0]
    assert choice.message.content == scripted.reply and not choice.message.tool_calls and choice.finish_reason == "stop"
    scripted.reply = "Hmm " + _call("get_weather", {"city": "Paris"})[:-3]  # cut short: not a call
    choice = _ask(client, tools=TOOLS).choices[0]
    assert choice.message.content == scripted.reply and not choice.message.tool_calls


def test_tools_go_into_the_prompt_and_tool_choice_none_leaves_them_out(client, scripted):
    scripted.reply = _call("get_weather", {"city": "Paris"})
    with_tools = _ask(client, tools=TOOLS, extra_body={"return_token_ids": True}).choices[0]
    without = _ask(client, tools=TOOLS, tool_choice="none", extra_body={"return_token_ids": True}).choices[0]
    tokenizer = scripted.tokenizer
    prompt = tokenizer.decode(with_tools.model_extra["prompt_token_ids"], skip_special_tokens=False)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    assert "<tools>" not in tokenizer.decode(without.model_extra["prompt_token_ids"], skip_special_tokens=False)
    assert not without.message.tool_calls and without.message.content == scripted.reply  # not parsed either
    for choice in ("sometimes", {"type": "function", "function": {"name": "get_news"}}):
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            _ask(client, tools=TOOLS, tool_choice=choice)
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        _ask(client, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="tools"):
        _ask(client, tools=[{"type": "function", "function": {"name": "bad name!"}}])


def test_a_conversation_goes_on_with_the_tools_results(client, scripted):
    scripted.reply = _call("get_weather", {"city": "Paris"}) + _call("get_weather", {"city": "Rome"})
    messages = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    first = _ask(client, tools=TOOLS, messages=messages).choices[0].message
    messages.append(first.model_dump(exclude_none=True))
    for call, result in zip(first.tool_calls, ("sunny", "rain"), strict=True):
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    scripted.reply = "Sunny in Paris, rain in Rome."
    second = _ask(client, tools=TOOLS, messages=messages, extra_body={"return_token_ids": True}).choices[0]
    assert second.message.content == scripted.reply and second.finish_reason == "stop"
    prompt = scripted.tokenizer.decode(second.model_extra["prompt_token_ids"], skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>" in prompt


# schemas a random model's constrained reply ends within max_tokens: bounded strings, no free keys
BOUNDED = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]


def _valid_call(call) -> bool:
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        return set(arguments) == {"city"} and isinstance(arguments["city"], str) and len(arguments["city"]) <= 10
    return call.function.name == "get_time" and arguments == {}


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choice_make_the_model_call(client, scripted, rng, stream):
    """The random-weight model's own replies, constrained by the tools' grammar, are always calls."""
    scripted.reply = None
    try:
        for choice, names in (
            ("required", {"get_weather", "get_time"}),
            ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
        ):
            kwargs = dict(tools=BOUNDED, tool_choice=choice, seed=rng.randrange(1 << 30))
            kwargs.update(parallel_tool_calls=choice != "required" or rng.random() < 0.5)
            # after a whole call the grammar lets the reply end or call again: favour the end (EOS),
            # which a random-weight model would not pick over another call (the mask keeps EOS out mid-call)
            kwargs["logit_bias"] = {str(t): 10 for t in scripted.tokenizer.eos_token_ids}
            if not stream:
                reply = _ask(client, **kwargs).choices[0]
                calls, finish = reply.message.tool_calls, reply.finish_reason
            else:
                chunks = list(_ask(client, stream=True, **kwargs))
                calls = [_Call(name, args) for _, _, name, args in _joined(chunks)]
                finish = chunks[-1].choices[0].finish_reason
            assert finish == "tool_calls" and calls, (choice, calls)
            assert all(c.function.name in names and _valid_call(c) for c in calls), calls
            if isinstance(choice, dict) or not kwargs["parallel_tool_calls"]:
                assert len(calls) == 1
    finally:
        scripted.reply = ""
