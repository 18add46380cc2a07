"""Request bodies -> engine sequences, and the 4xx each bad field gets (OpenAI's error shape, the
field named), without a server: qruntime.serve.protocol against the tiny artifact's tokenizer."""

from __future__ import annotations

import math
import random

import pytest
from qruntime import SamplingParams
from qruntime.serve.errors import APIError, error_body
from qruntime.serve.protocol import ServedModel, parse_chat, parse_completion
from qruntime.tokenizer import Tokenizer

MAX_MODEL_LEN = 64
MAX_SEQUENCES = 12
WORDS = ("the", "model", "runs", "fast", "hello", "world", "日本", "é")


@pytest.fixture(scope="module")
def model(tiny_ckpt, compiled) -> ServedModel:
    tokenizer = Tokenizer.from_dir(compiled(tiny_ckpt, "ptpc-fp8"))
    return ServedModel("tiny", tokenizer, 544, MAX_MODEL_LEN, 0, MAX_SEQUENCES)


def _text() -> str:
    return " ".join(random.choice(WORDS) for _ in range(random.randrange(1, 6)))


def _error(parse, body, model) -> APIError:
    with pytest.raises(APIError) as info:
        parse(body, model)
    return info.value


def test_completion_defaults_follow_openai(model):
    text = _text()
    request = parse_completion({"prompt": text}, model)
    (seq,) = request.sequences
    assert seq.prompt_ids == tuple(model.tokenizer.encode(text))
    assert seq.params == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0)
    assert (request.chat, request.stream, request.include_usage, request.return_token_ids) == (
        False,
        False,
        False,
        False,
    )
    assert request.prompt_lens == (len(seq.prompt_ids),)


def test_every_prompt_form_and_n_give_indexed_sequences(model):
    texts = [_text(), _text()]
    ids = [[random.randrange(544) for _ in range(random.randrange(1, 10))] for _ in range(3)]
    encoded = [model.tokenizer.encode(t) for t in texts]
    for prompt, expected in ((texts[0], encoded[:1]), (texts, encoded), (ids[0], ids[:1]), (ids, ids)):
        n = random.randrange(1, 4)
        request = parse_completion({"prompt": prompt, "n": n, "max_tokens": 3}, model)
        assert [s.index for s in request.sequences] == list(range(n * len(expected)))
        assert [list(s.prompt_ids) for s in request.sequences] == [e for e in expected for _ in range(n)]
        assert [s.prompt_index for s in request.sequences] == [p for p in range(len(expected)) for _ in range(n)]
        assert request.prompt_lens == tuple(map(len, expected))


def test_sampling_fields_reach_the_params(model):
    seed = random.randrange(1 << 40)
    temperature, top_p = random.uniform(0.1, 1.5), random.uniform(0.1, 1.0)
    body = {
        "prompt": _text(), "n": 3, "max_tokens": 5, "temperature": temperature, "top_p": top_p, "top_k": -1,
        "seed": seed, "stop": "x", "stop_token_ids": [7], "ignore_eos": True, "skip_special_tokens": False,
        "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True, "user": "ignored",
    }  # fmt: skip
    request = parse_completion(body, model)
    assert [s.params.seed for s in request.sequences] == [seed, seed + 1, seed + 2]  # choice j: seed + j
    p = request.sequences[0].params
    assert (p.temperature, p.top_p, p.top_k, p.stop, p.stop_token_ids) == (temperature, top_p, 0, ("x",), (7,))
    assert p.ignore_eos and not p.skip_special_tokens and p.max_tokens == 5
    assert request.stream and request.include_usage and request.return_token_ids
    assert parse_completion({"prompt": "a", "stop": ["a", "b"]}, model).sequences[0].params.stop == ("a", "b")
    min_p, least = random.uniform(0, 1), random.randrange(0, 5)
    bias = {str(random.randrange(model.vocab_size)): random.uniform(-100, 100) for _ in range(random.randrange(1, 6))}
    p = parse_chat(
        {"messages": [{"role": "user", "content": _text()}], "min_p": min_p, "min_tokens": least, "logit_bias": bias,
         "max_tokens": 5},
        model,
    ).sequences[0].params  # fmt: skip
    assert (p.min_p, p.min_tokens, p.logit_bias) == (min_p, least, tuple((int(k), v) for k, v in bias.items()))
    penalties = {"presence_penalty": random.uniform(-2, 2), "frequency_penalty": random.uniform(-2, 2),
                 "repetition_penalty": random.uniform(0.1, 3)}  # fmt: skip
    p = parse_completion({"prompt": _text(), **penalties}, model).sequences[0].params
    assert {k: getattr(p, k) for k in penalties} == penalties and p.penalized


def test_chat_renders_the_template_and_fills_the_context_by_default(model):
    # random words, redrawn until the rendered chat fits the 64-token context with room to generate
    # (two 5-word messages of the byte-level words can pass it: a fresh-clone CI run drew 67 tokens)
    while True:
        messages = [{"role": "system", "content": _text()}, {"role": "user", "content": _text()}]
        if len(model.tokenizer.encode_chat(messages)) < MAX_MODEL_LEN - 1:
            break
    request = parse_chat({"messages": messages, "temperature": 0}, model)
    (seq,) = request.sequences
    assert list(seq.prompt_ids) == model.tokenizer.encode_chat(messages)
    assert seq.params.max_tokens == MAX_MODEL_LEN - len(seq.prompt_ids)  # the room the prompt leaves
    # text parts join into the content; max_completion_tokens wins over max_tokens
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]
    request = parse_chat({"messages": parts, "max_completion_tokens": 3, "max_tokens": 9}, model)
    assert request.chat and request.sequences[0].params.max_tokens == 3
    plain = [{"role": "user", "content": "hello world"}]
    assert request.sequences[0].prompt_ids == tuple(model.tokenizer.encode_chat(plain))


def test_the_default_max_tokens_is_capped_by_the_context(model):
    ids = [random.randrange(544) for _ in range(MAX_MODEL_LEN - 5)]
    assert parse_completion({"prompt": ids}, model).sequences[0].params.max_tokens == 5


# (parse, body change, status, param, code, words the message must hold)
BAD = [
    (parse_completion, {"temperature": -1}, 400, "temperature", "invalid_value", ">= 0"),
    (parse_completion, {"temperature": "hot"}, 400, "temperature", "invalid_type", "number"),
    (parse_completion, {"temperature": math.nan}, 400, "temperature", "invalid_value", "finite"),
    (parse_completion, {"max_tokens": 0}, 400, "max_tokens", "invalid_value", ">= 1"),
    (parse_completion, {"max_tokens": "8"}, 400, "max_tokens", "invalid_type", "integer"),
    (parse_completion, {"max_tokens": True}, 400, "max_tokens", "invalid_type", "integer"),
    (parse_completion, {"max_tokens": 2.5}, 400, "max_tokens", "invalid_type", "integer"),
    (parse_completion, {"n": 0}, 400, "n", "invalid_value", ">= 1"),
    (parse_completion, {"n": 10**12}, 400, "n", "invalid_value", "n must be <= 128"),
    (parse_completion, {"n": 13}, 400, "n", "invalid_value", "sequences (prompts x n)"),
    (parse_completion, {"stop": ["x"] * 17}, 400, "stop", "invalid_value", "at most 16"),
    (parse_completion, {"stop": ["y" * 4000, "z" * 97]}, 400, "stop", "invalid_value", "4097 characters"),
    (parse_completion, {"stop_token_ids": [1] * 1025}, 400, "stop_token_ids", "invalid_value", "at most 1024"),
    (parse_completion, {"stop_token_ids": [544]}, 400, "stop_token_ids", "invalid_value", "not a token id"),
    (parse_chat, {"chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs", "invalid_value", "messages"),
    (parse_completion, {"n": 5, "prompt": ["a", "b", "c"]}, 400, "n", "invalid_value", "15 sequences"),
    (parse_completion, {"top_p": 0}, 400, "top_p", "invalid_value", "(0, 1]"),
    (parse_completion, {"top_k": -2}, 400, "top_k", "invalid_value", ">= -1"),
    (parse_completion, {"seed": -1}, 400, "seed", "invalid_value", ">= 0"),
    (parse_completion, {"seed": 1 << 64}, 400, "seed", "invalid_value", "2**63"),
    (parse_completion, {"stop": 5}, 400, "stop", "invalid_type", "string"),
    (parse_completion, {"stop": [""]}, 400, "stop", "invalid_type", "non-empty"),
    (parse_completion, {"stream": "yes"}, 400, "stream", "invalid_type", "boolean"),
    (parse_completion, {"stream_options": []}, 400, "stream_options", "invalid_type", "object"),
    (parse_completion, {"model": "gpt-4"}, 404, "model", "model_not_found", "`gpt-4` does not exist"),
    (parse_completion, {"model": 3}, 400, "model", "invalid_type", "string"),
    (parse_completion, {"prompt": None}, 400, "prompt", "missing", "required"),
    (parse_completion, {"prompt": ""}, 400, "prompt", "invalid_value", "empty"),
    (parse_completion, {"prompt": []}, 400, "prompt", "invalid_type", "token ids"),
    (parse_completion, {"prompt": [1, "a"]}, 400, "prompt", "invalid_type", "token ids"),
    (parse_completion, {"prompt": [1, 544]}, 400, "prompt", "invalid_value", "unknown token id 544 at position 1"),
    (parse_completion, {"prompt": [3, 5, -1, 2]}, 400, "prompt", "invalid_value", "unknown token id -1 at position 2"),
    (parse_completion, {"prompt": [1, True]}, 400, "prompt", "invalid_type", "token ids"),
    (parse_completion, {"prompt": [[1, 2], [4, 1.0]]}, 400, "prompt", "invalid_type", "token ids"),
    (parse_completion, {"prompt": list(range(MAX_MODEL_LEN))}, 400, "prompt", "context_length_exceeded", "max_model_len"),
    (parse_completion, {"max_tokens": MAX_MODEL_LEN}, 400, "max_tokens", "context_length_exceeded", "max_model_len"),
    (parse_completion, {"logprobs": 21}, 400, "logprobs", "invalid_value", "<= 20"),
    (parse_completion, {"logprobs": -1}, 400, "logprobs", "invalid_value", ">= 0"),
    (parse_completion, {"logprobs": True}, 400, "logprobs", "invalid_type", "integer"),
    (parse_completion, {"echo": "yes"}, 400, "echo", "invalid_type", "boolean"),
    (parse_completion, {"echo": True, "logprobs": 1, "stream": True}, 400, "echo", "invalid_value", "streaming"),
    (parse_completion, {"best_of": 1, "n": 2}, 400, "best_of", "invalid_value", ">= n (2)"),
    (parse_completion, {"best_of": 129}, 400, "best_of", "invalid_value", "<= 128"),
    (parse_completion, {"best_of": 3, "stream": True}, 400, "best_of", "invalid_value", "cannot be streamed"),
    (parse_completion, {"best_of": "two"}, 400, "best_of", "invalid_type", "integer"),
    (parse_chat, {"max_thinking_tokens": -1}, 400, "max_thinking_tokens", "invalid_value", ">= 0"),
    (parse_chat, {"max_thinking_tokens": "few"}, 400, "max_thinking_tokens", "invalid_type", "integer"),
    (parse_completion, {"presence_penalty": 2.5}, 400, "presence_penalty", "invalid_value", "[-2, 2]"),
    (parse_chat, {"frequency_penalty": "some"}, 400, "frequency_penalty", "invalid_type", "number"),
    (parse_chat, {"repetition_penalty": 0}, 400, "repetition_penalty", "invalid_value", "> 0"),
    (parse_completion, {"prompt_logprobs": 21}, 400, "prompt_logprobs", "invalid_value", "<= 20"),
    (parse_chat, {"prompt_logprobs": -1}, 400, "prompt_logprobs", "invalid_value", ">= 0"),
    (parse_chat, {"prompt_logprobs": "1"}, 400, "prompt_logprobs", "invalid_type", "integer"),
    (parse_completion, {"prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", "invalid_value", "streaming"),
    (parse_completion, {"logit_bias": [1, 2]}, 400, "logit_bias", "invalid_type", "object"),
    (parse_completion, {"logit_bias": {"x7": 1}}, 400, "logit_bias", "invalid_value", "not a token id"),
    (parse_completion, {"logit_bias": {"544": 1}}, 400, "logit_bias", "invalid_value", "not a token id"),
    (parse_completion, {"logit_bias": {"5": "up"}}, 400, "logit_bias", "invalid_type", "must be a number"),
    (parse_completion, {"logit_bias": {"5": 101}}, 400, "logit_bias", "invalid_value", "[-100, 100]"),
    (parse_completion, {"logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias", "invalid_value", "at most 300"),
    (parse_completion, {"min_p": 1.5}, 400, "min_p", "invalid_value", "[0, 1]"),
    (parse_completion, {"min_p": "high"}, 400, "min_p", "invalid_type", "number"),
    (parse_completion, {"min_tokens": -1}, 400, "min_tokens", "invalid_value", ">= 0"),
    (parse_completion, {"min_tokens": 9, "max_tokens": 4}, 400, "min_tokens", "invalid_value", "max tokens (4)"),
    (parse_chat, {"messages": []}, 400, "messages", "invalid_value", "non-empty list"),
    (parse_chat, {"messages": ["hi"]}, 400, "messages", "invalid_type", "must be an object"),
    (parse_chat, {"messages": [{"role": "user"}]}, 400, "messages", "invalid_value", "content"),
    (parse_chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages", "invalid_value", "text parts"),
    (parse_chat, {"max_completion_tokens": 0}, 400, "max_completion_tokens", "invalid_value", ">= 1"),
    (parse_chat, {"max_tokens": 10 * MAX_MODEL_LEN}, 400, "max_tokens", "context_length_exceeded", "max_model_len"),
    (parse_chat, {"tools": [{"type": "function"}]}, 400, "tools", "invalid_value", "tools[0]"),
    (parse_chat, {"tools": {"get": 1}}, 400, "tools", "invalid_type", "list"),
    (parse_chat, {"tools": [{"type": "function", "function": {"name": "f"}}] * 129}, 400, "tools", "invalid_value", "at most 128"),
    (parse_chat, {"tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "tools", "invalid_value", "letters"),
    (parse_chat, {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, 400, "tools", "invalid_type", "schema"),
    (parse_chat, {"tool_choice": "required"}, 400, "tool_choice", "invalid_value", "needs tools"),
    (parse_chat, {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice", "invalid_value", "not one of the tools"),
    (parse_chat, {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"function": "f"}}, 400, "tool_choice", "invalid_value", "named tool_choice"),
    (parse_chat, {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "response_format": {"type": "json_object"}}, 400, "tool_choice", "invalid_value", "no other constraint"),
    (parse_chat, {"tool_choice": "sometimes"}, 400, "tool_choice", "invalid_value", "'auto'"),
    (parse_chat, {"functions": [{"name": "f"}]}, 400, "functions", "unsupported", "not supported"),
    (parse_chat, {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]}, 400, "messages", "invalid_value", "tool_calls[0]"),
    (parse_chat, {"messages": [{"role": "assistant", "content": None, "tool_calls": "f"}]}, 400, "messages", "invalid_type", "list"),
    (parse_chat, {"top_logprobs": 2}, 400, "top_logprobs", "invalid_value", "needs logprobs"),
    (parse_chat, {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value", "<= 20"),
    (parse_chat, {"logprobs": 1}, 400, "logprobs", "invalid_type", "boolean"),
    (parse_chat, {"chat_template_kwargs": [1]}, 400, "chat_template_kwargs", "invalid_type", "object"),
]  # fmt: skip


@pytest.mark.parametrize(("parse", "change", "status", "param", "code", "words"), BAD)
def test_bad_fields_are_named_in_openai_errors(model, parse, change, status, param, code, words):
    base = {"messages": [{"role": "user", "content": _text()}]} if parse is parse_chat else {"prompt": _text()}
    body = {k: v for k, v in {**base, **change}.items() if v is not None}
    error = _error(parse, body, model)
    assert (error.status, error.param, error.code) == (status, param, code), error
    assert words in error.message and (param in error.message or param == "prompt"), error.message
    shape = error.body()
    assert shape == {"error": {"message": error.message, "type": "invalid_request_error", "param": param, "code": code}}


def test_the_body_must_be_an_object(model):
    for body in ([1, 2], "text", 3, None):
        error = _error(parse_completion, body, model)
        assert error.status == 400 and "JSON object" in error.message


def test_fields_that_are_off_are_accepted(model):
    off = {
        "logprobs": None,
        "echo": False,
        "best_of": None,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
    }
    assert len(parse_completion({"prompt": "hi", **off}, model).sequences) == 1
    chat_off = {"logprobs": False, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}}
    assert len(parse_chat({"messages": [{"role": "user", "content": "hi"}], **chat_off}, model).sequences) == 1


def test_error_types_by_status():
    assert error_body(429, "busy")["error"]["type"] == "rate_limit_error"
    assert error_body(503, "down")["error"]["type"] == "server_error"
    assert error_body(500, "bug")["error"] == {"message": "bug", "type": "server_error", "param": None, "code": None}
