"""The server's prefix cache: /metrics counts the prompt tokens looked up and found (counters) and the
hit rate (a gauge) as requests sharing a prefix come in, each response's usage says how many of its
prompt tokens were cached (prompt_tokens_details.cached_tokens), all 0 with the cache off; `--no-prefix-cache`
reaches qruntime.load."""

from __future__ import annotations

import json

import httpx
import pytest
import qruntime
from qruntime.cli import build_parser
from qruntime.serve.app import build_app
from qruntime.serve.options import serve_options_from
from serve_harness import ServerProcess, ThreadedServer, metrics, wait_idle

BLOCK = 16  # the tiny artifact's KV block size


@pytest.fixture(scope="module")
def art(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "ptpc-fp8")


def _complete(client: httpx.Client, prompt: list[int]) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _streamed_usage(client: httpx.Client, prompt: list[int]) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    events = client.post("/v1/completions", json=body).text.strip().split("\n\n")
    return json.loads(events[-2].removeprefix("data: "))["usage"]  # the chunk before [DONE]


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["on", "off"])
def test_metrics_count_prefix_cache_queries_and_hits(art, rng, prefix_cache):
    engine = qruntime.load(art, "cpu", max_model_len=128, num_kv_blocks=32, prefix_cache=prefix_cache)
    prefix = [rng.randrange(engine.vocab_size) for _ in range(2 * BLOCK + 5)]
    prompts = [prefix + [rng.randrange(engine.vocab_size) for _ in range(rng.randint(1, 9))] for _ in range(3)]
    with (
        ThreadedServer(build_app(engine, model_name="m")) as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        before = metrics(server.url)
        assert before["qruntime_prefix_cache_queries_total"] == before["qruntime_prefix_cache_hits_total"] == 0
        assert before["qruntime_prefix_cache_hit_rate"] == 0
        cached = []
        for i, prompt in enumerate(prompts):  # one after another: each later one finds the first's 2 prefix blocks
            if i < 2:
                cached.append(_complete(client, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"])
            else:  # streamed: the usage chunk says it too
                cached.append(_streamed_usage(client, prompt)["prompt_tokens_details"]["cached_tokens"])
        m = wait_idle(server.url)
    assert cached == ([0, 2 * BLOCK, 2 * BLOCK] if prefix_cache else [0, 0, 0])
    queries, hits = m["qruntime_prefix_cache_queries_total"], m["qruntime_prefix_cache_hits_total"]
    if prefix_cache:
        assert queries == sum(map(len, prompts)) and hits == 2 * 2 * BLOCK
        assert m["qruntime_prefix_cache_hit_rate"] == pytest.approx(hits / queries)
    else:
        assert queries == hits == m["qruntime_prefix_cache_hit_rate"] == 0


def test_no_prefix_cache_flag_reaches_the_engine(art, rng):
    parse = build_parser().parse_args
    assert serve_options_from(vars(parse(["serve", "ART"]))).prefix_cache is True
    assert serve_options_from(vars(parse(["serve", "ART", "--no-prefix-cache"]))).prefix_cache is False
    prompt = [rng.randrange(500) for _ in range(2 * BLOCK + 1)]
    with ServerProcess(art, "--threads", "1", "--no-prefix-cache", "--served-model-name", "m") as server:
        assert "prefix cache off" in server.stderr  # the load line
        with httpx.Client(base_url=server.url, timeout=60) as client:
            _complete(client, prompt)
            _complete(client, prompt)
        assert wait_idle(server.url)["qruntime_prefix_cache_queries_total"] == 0
