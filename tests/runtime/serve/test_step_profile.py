"""bench/step_profile.py on CPU: a real `qruntime serve` process under the step timers records every
engine step (the tokens of all steps add up to what the requests computed), and serve_profile's
aggregation turns the records into the per-level table."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def art(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "ptpc-fp8")


def test_every_step_is_recorded_and_aggregated(tmp_path, art, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from loadgen import random_token_specs, run_load, summarize
    from serve_bench import start_server
    from serve_profile import client_requests, level_profile, timeline, way_in
    from step_profile import STEP_KEYS

    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    prompt_len, output_len, requests = rng.randint(9, 40), rng.randint(3, 9), 6
    out = tmp_path / "profile.json"
    launcher = [sys.executable, str(ROOT / "bench" / "step_profile.py"), str(out), "--switch-interval", "0.002"]
    proc, url = start_server(art, 4, launcher=launcher)
    try:
        import httpx

        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        specs = random_token_specs(requests, prompt_len, output_len, 500, rng, model)
        t0 = time.time()
        clock = time.time() - time.perf_counter()
        results, wall = asyncio.run(run_load(url, specs, 3))
        t1 = time.time()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    assert all(r.error is None and r.status == 200 for r in results)
    profile = json.loads(out.read_text())
    steps = profile["steps"]
    # each request computes its prompt and then every output token but the last as an input
    assert sum(s["tokens"] for s in steps) == requests * (prompt_len + output_len - 1)
    # the text is the HTTP side's (the engine sends ids): no step of the server's engine detokenizes
    launch, read = {"schedule", "execute", "prepare", "sample"}, {"read", "update", "stop"}
    assert not any("detok" in s for s in steps) and sum(profile["http_text"].values()) > 0
    assert launch | read <= set(STEP_KEYS)
    assert all(s["graph"] is False and launch <= set(s) for s in steps)  # CPU: eager
    # async scheduling: a call reads the step the call before launched; only a call that finds the
    # engine idle (at most once per request) has none to read
    assert sum(read <= set(s) for s in steps) >= len(steps) - requests
    assert all(0 < s["execute"] < s["wall"] and s["prepare"] < s["execute"] for s in steps)
    # the engine runs in a process of its own: its threads apart from the HTTP process's
    assert any("qruntime-engine" in snap["cpu_s"] for snap in profile["threads"])
    assert profile["http_threads"] and not any("qruntime-engine" in snap["cpu_s"] for snap in profile["http_threads"])

    level = level_profile(profile, t0, t1, 3)
    assert level["all"]["steps"] == len(steps) == level["eager"]["steps"] and level["graph"]["steps"] == 0
    assert level["eager_step_share"] == 1.0 and 0 < level["engine_busy"] <= 1
    assert level["all"]["ms"]["wall"] > level["all"]["ms"]["execute"] > 0 and level["http_text_per_wall_s"] > 0
    assert summarize(results, wall, 3)["completed"] == requests
    # the timeline: every step in order, each request handed to the engine before exactly one of them
    rows = timeline(profile, t0, t1)
    assert len(rows) == len(steps) and sum(r["added"] for r in rows) == requests
    assert [r["t_ms"] for r in rows] == sorted(r["t_ms"] for r in rows) and rows[0]["t_ms"] >= 0
    assert [r["tokens"] for r in rows] == [s["tokens"] for s in steps]

    # each request's way in, joined by id: handed over, received, added, in that order, before its first token
    joined = client_requests(results, clock, t0)
    assert len({r["id"] for r in joined}) == requests and all(r["id"] in profile["requests"] for r in joined)
    for r in joined:
        stamps = profile["requests"][r["id"]]
        assert stamps["arrive"] <= stamps["submit"] <= stamps["recv"] <= stamps["add"]
        assert r["sent_ms"] <= (stamps["submit"] - t0) * 1e3 and (stamps["add"] - t0) * 1e3 <= r["first_ms"] <= r["end_ms"]
    stages = way_in(joined, profile, t0)
    assert set(stages) == {"to_handler", "to_submit", "pipe", "pickup", "to_first"}
    assert all(0 <= v["p50"] <= v["p99"] for v in stages.values()) and stages["to_first"]["p50"] > 0
