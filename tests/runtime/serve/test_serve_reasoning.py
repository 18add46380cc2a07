"""--reasoning-parser qwen3: a chat reply's thinking comes back as reasoning_content, apart from
content, whole and streamed, equal to qruntime.reasoning's split of the engine's own reply. A
checkpoint whose template opens the <think> block in the prompt (as Qwen3's thinking-only releases
do) makes every reply of the random-weight model reasoning, so the split is exercised end to end;
with the parser off, or with enable_thinking false, the reply is all content."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import qruntime
from qruntime import SamplingParams
from qruntime.reasoning import split_reasoning
from qruntime.serve.app import build_app
from serve_harness import CPU_LOAD, ThreadedServer

WORDS = ("the", "model", "thinks", "then", "answers", "hello", "world")
OPEN = "{{- '<|im_start|>assistant\\n' }}"


@pytest.fixture(scope="module")
def opening_ckpt(tiny_ckpt, tmp_path_factory):
    """tiny_ckpt with a chat template that opens the thinking block at the generation prompt."""
    ckpt = tmp_path_factory.mktemp("opening") / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    config_path = ckpt / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    assert OPEN in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(OPEN, "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    config_path.write_text(json.dumps(config))
    return ckpt


@pytest.fixture(scope="module")
def art(opening_ckpt, compiled):
    return compiled(opening_ckpt, "ptpc-fp8")


@pytest.fixture(scope="module")
def reference(art):
    return qruntime.load(art, **CPU_LOAD)


@pytest.fixture(scope="module")
def client(art):
    app = build_app(qruntime.load(art, **CPU_LOAD), model_name="m", reasoning_parser="qwen3")
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _messages(rng):
    return [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 7)))}]


def test_whole_and_streamed_replies_split_as_the_engines_own(client, reference, rng):
    messages = _messages(rng)
    tokens = rng.randrange(4, 16)
    body = {"messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    (expected,) = reference.chat(messages, SamplingParams(max_tokens=tokens, ignore_eos=True))
    split = split_reasoning(expected.text, opened=True)
    assert split.reasoning  # the prompt opened the block: the reply starts in it
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": split.content or None,
        "reasoning_content": split.reasoning or None,
    }
    streamed = client.post("/v1/chat/completions", json={**body, "stream": True}).text
    deltas = [json.loads(e.removeprefix("data: "))["choices"] for e in streamed.strip().split("\n\n")[:-1]]
    parts = [c[0]["delta"] for c in deltas if c]
    assert "".join(p.get("reasoning_content", "") for p in parts) == split.reasoning
    assert "".join(p.get("content", "") for p in parts) == split.content


def test_thinking_off_is_all_content(client, reference, rng):
    messages = _messages(rng)
    kwargs = {"enable_thinking": False}
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "chat_template_kwargs": kwargs}
    (expected,) = reference.chat(messages, SamplingParams(max_tokens=6), **kwargs)
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    # the template wrote `<think>\n<think>\n\n</think>\n\n`: closed, so the reply is the answer
    assert message["content"] == (split_reasoning(expected.text).content or None)
    assert message["reasoning_content"] is None


def test_without_the_parser_the_reply_is_whole(art, reference, rng):
    app = build_app(qruntime.load(art, **CPU_LOAD), model_name="m")
    messages = _messages(rng)
    (expected,) = reference.chat(messages, SamplingParams(max_tokens=5))
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        body = {"messages": messages, "max_tokens": 5, "temperature": 0}
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": expected.text}


def test_an_unknown_parser_is_refused(reference):
    with pytest.raises(ValueError, match="reasoning_parser must be one of qwen3"):
        build_app(reference, model_name="m", reasoning_parser="deepseek")
