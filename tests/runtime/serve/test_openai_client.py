"""The server through the official `openai` client (as people call it): sampling fields OpenAI has
(logit_bias, presence / frequency penalties, stop, n) and vLLM's extras (min_p, min_tokens,
repetition_penalty, through extra_body) give what the engine gives for the same SamplingParams, whole
and streamed, and a bad field is a BadRequestError naming it. Logprobs: completions' `logprobs` k
(OpenAI's legacy lists, `echo` putting the prompt's tokens first) and chat's `logprobs` /
`top_logprobs` (entries with `bytes`), whole and streamed, equal the engine's own."""

from __future__ import annotations

import json
import re

import openai
import pytest
import qruntime
from qruntime import SamplingParams
from qruntime.serve.app import build_app
from serve_harness import CPU_LOAD, ThreadedServer, random_text

MODEL = "tiny-openai"
TOLERANCE = 1e-6  # the engine's float32 logprobs through JSON and back


@pytest.fixture(scope="module")
def art(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "ptpc-fp8")


@pytest.fixture(scope="module")
def reference(art):
    return qruntime.load(art, **CPU_LOAD)


@pytest.fixture(scope="module")
def client(art):
    app = build_app(qruntime.load(art, **CPU_LOAD), model_name=MODEL, max_waiting=32)
    with ThreadedServer(app) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_sampling_fields_give_the_engines_tokens_whole_and_streamed(client, reference, rng):
    prompt = random_text(rng)
    (free,) = reference.generate([prompt], SamplingParams(max_tokens=1))
    banned = free.token_ids[0]  # what greedy picks first: its -100 bias must change the reply
    fields = {
        # another token than the banned one: drawn equal (1 in 200), its small bias replaced the -100
        "logit_bias": {str(banned): -100, str(rng.choice([t for t in range(200) if t != banned])): rng.uniform(-3, 3)},
        "presence_penalty": rng.uniform(-2, 2),
        "frequency_penalty": rng.uniform(-2, 2),
    }
    extra = {"min_p": rng.uniform(0, 0.3), "min_tokens": rng.randrange(0, 4), "repetition_penalty": rng.uniform(0.5, 3)}
    common = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, n=2, **fields)
    whole = client.completions.create(**common, extra_body=extra)
    streamed = list(client.completions.create(**common, stream=True, extra_body=extra))
    bias = tuple((int(k), float(v)) for k, v in fields["logit_bias"].items())
    params = SamplingParams(
        max_tokens=10, logit_bias=bias, presence_penalty=fields["presence_penalty"],
        frequency_penalty=fields["frequency_penalty"], **extra,
    )  # fmt: skip
    (expected,) = reference.generate([prompt], params)
    assert banned not in expected.token_ids
    assert [c.text for c in whole.choices] == [expected.text] * 2
    for index in range(2):
        chunks = [c for chunk in streamed for c in chunk.choices if c.index == index]
        assert "".join(c.text for c in chunks) == expected.text
        assert chunks[-1].finish_reason == expected.finish_reason
    assert whole.usage.completion_tokens == 2 * len(expected.token_ids)


def test_a_chat_stops_at_its_stop_string_streamed(client, reference, rng):
    for _ in range(20):  # a reply long enough to cut mid-way with a stop string
        messages = [{"role": "user", "content": random_text(rng)}]
        (free,) = reference.chat(messages, SamplingParams(max_tokens=30, ignore_eos=True))
        text = free.text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        (expected,) = reference.chat(messages, SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,)))
        if len(text) >= 8 and expected.finish_reason == "stop":
            break
    else:
        pytest.fail("no reply of the tiny model was long enough to cut with a stop string")
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30, temperature=0, stop=[stop], stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected.text and stop not in content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"logit_bias": {"not-a-token": 5}}, "logit_bias"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"extra_body": {"min_p": 2}}, "min_p"),
        ({"extra_body": {"repetition_penalty": -1}}, "repetition_penalty"),
    ],
)
def test_a_bad_field_is_a_bad_request_naming_it(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=3, **kwargs)
    assert caught.value.status_code == 400 and caught.value.body["param"] == param


def _text(reference, token_id: int) -> str:
    return reference.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE


def test_completion_logprobs_are_the_engines_whole_and_streamed(client, reference, rng):
    prompt = random_text(rng)
    k = rng.randrange(1, 5)
    (expected,) = reference.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=k))
    common = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=k, extra_body={"ignore_eos": True})
    whole = client.completions.create(**common).choices[0].logprobs
    assert whole.tokens == [_text(reference, t) for t in expected.token_ids]
    assert all(_close(a, e.logprob) for a, e in zip(whole.token_logprobs, expected.logprobs, strict=True))
    for top, entry in zip(whole.top_logprobs, expected.logprobs, strict=True):
        want = {}
        for token_id, logprob in entry.top:
            want.setdefault(_text(reference, token_id), logprob)
        assert top.keys() == want.keys() and all(_close(top[t], want[t]) for t in want)
    lengths = [len(t) for t in whole.tokens]
    assert whole.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    chunks = [c.choices[0].logprobs for c in client.completions.create(**common, stream=True) if c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens] == whole.tokens
    assert [lp for c in chunks for lp in c.token_logprobs] == whole.token_logprobs
    assert [o for c in chunks for o in c.text_offset] == whole.text_offset


def test_echo_puts_the_prompt_and_its_logprobs_first(client, reference, rng):
    prompt_ids = [rng.randrange(10, 500) for _ in range(rng.randrange(5, 40))]
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    (expected,) = reference.generate([prompt_ids], params)
    choice = client.completions.create(
        model=MODEL,
        prompt=prompt_ids,
        max_tokens=4,
        temperature=0,
        logprobs=1,
        echo=True,
        extra_body={"ignore_eos": True},
    ).choices[0]
    prompt_text = reference.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    assert choice.text == prompt_text + expected.text
    lp = choice.logprobs
    ids = [*prompt_ids, *expected.token_ids]
    assert lp.tokens == [_text(reference, t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    entries = [*expected.prompt_logprobs[1:], *expected.logprobs]
    assert all(_close(a, e.logprob) for a, e in zip(lp.token_logprobs[1:], entries, strict=True))
    streamed = list(
        client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=4, temperature=0, echo=True, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed).startswith(prompt_text)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=2, echo=True, logprobs=1, stream=True)


def _check_prompt_logprobs(got: list, expected, k: int, reference) -> None:
    """vLLM's prompt_logprobs against the engine's: None first, then per prompt token its logprob and
    rank and the k likeliest (ranks 1..k), keyed by token id."""
    assert got[0] is None and len(got) == len(expected.prompt_logprobs)
    for position, entry in zip(got[1:], expected.prompt_logprobs[1:], strict=True):
        mine = position[str(entry.token_id)]
        assert _close(mine["logprob"], entry.logprob) and mine["rank"] == entry.rank >= 1
        assert mine["decoded_token"] == _text(reference, entry.token_id)
        for rank, (token_id, logprob) in enumerate(entry.top[:k], start=1):
            top = position[str(token_id)]
            assert _close(top["logprob"], logprob) and top["rank"] == (
                rank if token_id != entry.token_id else entry.rank
            )
        assert len(position) in (k, k + 1)  # the prompt's token beside the top k, unless among them


def test_prompt_logprobs_are_vllms_extra_for_completions_and_chat(client, reference, rng):
    prompt_ids = [rng.randrange(10, 500) for _ in range(rng.randrange(5, 30))]
    k = rng.randrange(0, 4)
    (expected,) = reference.generate(
        [prompt_ids], SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=max(k, 1))
    )
    completion = client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": k}
    )
    _check_prompt_logprobs(completion.choices[0].model_extra["prompt_logprobs"], expected, k, reference)
    messages = [{"role": "user", "content": random_text(rng)}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": k}
    )
    got = chat.model_extra["prompt_logprobs"]
    assert got[0] is None and all(len(p) in (k, k + 1) for p in got[1:]) and len(got) == chat.usage.prompt_tokens
    plain = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})


def test_chat_logprobs_are_the_engines_whole_and_streamed(client, reference, rng):
    messages = [{"role": "user", "content": random_text(rng)}]
    k = rng.randrange(0, 4)
    (expected,) = reference.chat(messages, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=k))
    common = dict(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=k,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = client.chat.completions.create(**common).choices[0].logprobs.content
    assert [c.token for c in content] == [_text(reference, t) for t in expected.token_ids]
    assert [bytes(c.bytes) for c in content] == [reference.tokenizer.token_bytes(t) for t in expected.token_ids]
    for item, entry in zip(content, expected.logprobs, strict=True):
        assert _close(item.logprob, entry.logprob) and len(item.top_logprobs) == k
        for top, (token_id, logprob) in zip(item.top_logprobs, entry.top, strict=True):
            assert top.token == _text(reference, token_id) and _close(top.logprob, logprob)
    streamed = [
        c.choices[0].logprobs.content
        for c in client.chat.completions.create(**common, stream=True)
        if c.choices and c.choices[0].logprobs
    ]
    assert [(c.token, c.logprob) for part in streamed for c in part] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_best_of_returns_the_sequences_with_the_highest_mean_logprob(client, reference, rng):
    prompt = random_text(rng)
    seed, n, best_of = rng.randrange(1 << 30), 2, 4
    runs = [
        reference.generate(
            [prompt], SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.3, seed=seed + j, logprobs=0)
        )[0]
        for j in range(best_of)
    ]
    means = [sum(e.logprob for e in o.logprobs) / len(o.logprobs) for o in runs]
    ranked = sorted(range(best_of), key=lambda j: (-means[j], j))
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=1.3, seed=seed, n=n, best_of=best_of,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in response.choices] == [runs[j].text for j in ranked[:n]]
    assert [c.index for c in response.choices] == [0, 1] and all(c.logprobs is None for c in response.choices)
    assert response.usage.completion_tokens == sum(len(o.token_ids) for o in runs)  # every sequence generated
    assert len({o.text for o in runs}) > 1, "the sampled sequences were all alike: nothing was ranked"


def test_max_thinking_tokens_closes_the_block(client, reference, rng):
    backend = reference.tokenizer.backend
    open_id, close_id = backend.token_to_id("<think>"), backend.token_to_id("</think>")
    cap = rng.randrange(0, 4)
    prompt = [rng.randrange(10, 400) for _ in range(12)] + [open_id]
    bias = {str(open_id): -100, str(close_id): -100}  # the model never opens or closes a block itself
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=cap + 4, temperature=0, logit_bias=bias,
        extra_body={"ignore_eos": True, "max_thinking_tokens": cap, "return_token_ids": True, "skip_special_tokens": False},
    )  # fmt: skip
    ids = response.choices[0].model_extra["token_ids"]
    assert ids[cap] == close_id and ids.count(close_id) == 1, ids


def test_response_format_and_guided_fields_constrain_the_reply(client, reference, rng):
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": random_text(rng)}]
    common = dict(model=MODEL, messages=messages, max_tokens=120, temperature=1.0, seed=rng.randrange(1 << 30))
    response_format = {"type": "json_schema", "json_schema": {"name": "trip", "schema": schema}}
    # any JSON object allows strings of any length: favouring '"' and '}' ends them within max_tokens
    closing = {str(t): 8 for t in (*reference.tokenizer.encode('"', False), *reference.tokenizer.encode("}", False))}
    whole = client.chat.completions.create(**common, response_format=response_format).choices[0]
    reply = json.loads(whole.message.content)
    assert whole.finish_reason == "stop" and reply["city"] in ("Paris", "Rome") and 1 <= reply["days"] <= 9
    streamed = client.chat.completions.create(**common, response_format=response_format, stream=True)
    assert json.loads("".join(c.choices[0].delta.content or "" for c in streamed if c.choices)) == reply
    assert isinstance(
        json.loads(
            client.chat.completions.create(**common, response_format={"type": "json_object"}, logit_bias=closing)
            .choices[0]
            .message.content
        ),
        dict,
    )
    regex = client.completions.create(
        model=MODEL, prompt=random_text(rng), max_tokens=20, extra_body={"guided_regex": "[xyz]{3}[0-9]"}
    )
    assert re.fullmatch("[xyz]{3}[0-9]", regex.choices[0].text)
    choice = client.completions.create(
        model=MODEL, prompt=random_text(rng), max_tokens=20, extra_body={"guided_choice": ["up", "down"]}
    )
    assert choice.choices[0].text in ("up", "down")
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            **common, response_format={"type": "json_schema", "json_schema": {"schema": {"type": "no"}}}
        )
    with pytest.raises(openai.BadRequestError, match="one output constraint"):
        client.chat.completions.create(
            **common, response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}
        )
