"""Backpressure: past --max-waiting a request gets 429 with Retry-After while the accepted ones
complete; a request that can never fit the context gets 400 naming max_model_len."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import qruntime
from qruntime import SamplingParams
from serve_harness import ServerProcess, load_loadgen, torch_threads, wait_idle

MAX_WAITING = 2


@pytest.fixture(scope="module")
def art(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "ptpc-fp8")


def test_a_burst_past_max_waiting_gets_429_and_the_rest_complete(art):
    loadgen = load_loadgen()
    prompts = [[random.randrange(500) for _ in range(random.randrange(3, 12))] for _ in range(8)]
    burst = [
        loadgen.RequestSpec(
            loadgen.COMPLETIONS, {"prompt": p, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
        )
        for p in prompts
    ]
    # one sequence runs at a time; a long stream holds that slot while the burst arrives
    blocker = {"prompt": [1, 2, 3], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    args = ("--max-num-seqs", "1", "--max-waiting", str(MAX_WAITING), "--threads", "1")
    with ServerProcess(art, *args) as server:

        async def go():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                async with client.stream("POST", loadgen.COMPLETIONS, json=blocker) as stream:
                    lines = stream.aiter_lines()
                    while not (await anext(lines)).startswith("data: "):
                        pass  # the blocker is running once its first token arrives
                    tasks = [asyncio.create_task(loadgen.send(client, spec)) for spec in burst]
                    # the refused come back at once; the accepted wait behind the blocker
                    while sum(t.done() for t in tasks) < len(burst) - MAX_WAITING:
                        await asyncio.sleep(0.01)
                    await asyncio.sleep(0.2)
                    assert sum(t.done() for t in tasks) == len(burst) - MAX_WAITING
                # leaving the stream closes it: the server aborts the blocker, the waiting ones run
                return await asyncio.gather(*tasks)

        results = asyncio.run(go())
        after = wait_idle(server.url)

    rejected = [r for r in results if r.status == 429]
    accepted = [r for r in results if r.status == 200]
    assert len(accepted) == MAX_WAITING and len(rejected) == len(burst) - MAX_WAITING
    for r in rejected:
        assert r.headers["retry-after"] == "1"
        error = r.body["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
        assert f"at most {MAX_WAITING}" in error["message"]
    engine = qruntime.load(art, "cpu")
    with torch_threads(1):
        for r in accepted:
            (expected,) = engine.generate(r.spec.body["prompt"], SamplingParams(max_tokens=5))
            assert r.choices()[0]["token_ids"] == list(expected.token_ids)
    assert after['qruntime_requests_rejected_total{status="429"}'] == len(rejected)
    assert after['qruntime_request_success_total{finish_reason="abort"}'] == 1  # the blocker
    assert after["qruntime_kv_cache_blocks_used"] == 0


def test_a_request_that_can_never_fit_gets_400_naming_the_limit(art):
    server = ServerProcess(art, "--max-model-len", "48", "--max-waiting", "4")
    with server, httpx.Client(base_url=server.url, timeout=60) as client:
        long_prompt = [random.randrange(500) for _ in range(48)]
        response = client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert "max_model_len" in error["message"] and "48 tokens" in error["message"]

        prompt = long_prompt[: random.randrange(10, 40)]
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 48 - len(prompt) + 1})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "max_tokens" and "max_model_len" in error["message"]
        assert f"at most {48 - len(prompt)}" in error["message"]

        fits = client.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 48 - len(prompt), "ignore_eos": True}
        )
        assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 48 - len(prompt)

        response = client.post("/v1/completions", json={"prompt": "hi", "n": 5})  # 5 sequences > --max-waiting 4
        assert response.status_code == 400 and "--max-waiting" in response.json()["error"]["message"]
