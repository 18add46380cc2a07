"""Load generator for an OpenAI-compatible server (`qruntime serve`, vLLM, SGLang): N requests from
C concurrent clients, streamed, timed per chunk; TTFT / TPOT / ITL percentiles and output tokens
per second for each concurrency level.

    python bench/loadgen.py --url http://127.0.0.1:8000 --concurrency 1,8,32,64,128 \
        --input-len 128 --output-len 128 --num-prompts 256 --out bench/results/serve_load.json

Prompts are random token ids (ids below --vocab-size, exactly --input-len of them) sent to
/v1/completions with ignore_eos, so every request generates exactly --output-len tokens. The
client side is also a library: `run_load(url, specs, concurrency)` sends any mix of RequestSpecs
(chat or completions, streamed or not, cancelled after some chunks, malformed bodies) and returns
one Result per spec; the server's load test uses it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class RequestSpec:
    """One request: `body` as JSON, or `raw` bytes as they are (malformed bodies). A streamed request
    with `cancel_after` closes its connection after that many data chunks."""

    path: str
    body: dict[str, Any] | None = None
    raw: bytes | None = None
    cancel_after: int | None = None
    tag: Any = None  # the caller's label, handed back on the Result

    @property
    def stream(self) -> bool:
        return bool(self.body and self.body.get("stream"))


@dataclass
class Result:
    """What came back for one RequestSpec. Times are time.perf_counter() seconds."""

    spec: RequestSpec
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None  # a whole response's JSON (or an error's)
    chunks: list[dict[str, Any]] = field(default_factory=list)  # a stream's data objects
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with new text or tokens
    done: bool = False  # the stream ended with data: [DONE]
    cancelled: bool = False  # we closed the stream after spec.cancel_after chunks
    error: str | None = None  # transport error or unreadable response
    start: float = 0.0
    end: float = 0.0

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        """Inter-chunk latencies of a stream."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    def choices(self) -> dict[int, dict[str, Any]]:
        """index -> {"text", "finish_reason", and with return_token_ids "token_ids", "prompt_token_ids"},
        from a whole response or assembled from a stream's chunks."""
        out: dict[int, dict[str, Any]] = {}
        if isinstance(self.body, dict) and "choices" in self.body:
            for c in self.body["choices"]:
                text = c["message"]["content"] if "message" in c else c["text"]
                out[c["index"]] = {
                    "text": text,
                    "finish_reason": c["finish_reason"],
                    "token_ids": c.get("token_ids"),
                    "prompt_token_ids": c.get("prompt_token_ids"),
                }
            return out
        for chunk in self.chunks:
            for c in chunk.get("choices", ()):
                entry = out.setdefault(
                    c["index"], {"text": "", "finish_reason": None, "token_ids": [], "prompt_token_ids": None}
                )
                entry["text"] += (c["delta"].get("content") or "") if "delta" in c else c["text"]
                entry["token_ids"] += c.get("token_ids") or []
                entry["finish_reason"] = c.get("finish_reason") or entry["finish_reason"]
                entry["prompt_token_ids"] = c.get("prompt_token_ids") or entry["prompt_token_ids"]
        return out

    @property
    def usage(self) -> dict[str, int] | None:
        if isinstance(self.body, dict) and "usage" in self.body:
            return self.body["usage"]
        return next((c["usage"] for c in reversed(self.chunks) if c.get("usage")), None)

    @property
    def output_tokens(self) -> int:
        usage = self.usage
        if usage is not None:
            return usage["completion_tokens"]
        return sum(len(c["token_ids"] or ()) for c in self.choices().values())


def _content(spec: RequestSpec) -> bytes:
    return spec.raw if spec.raw is not None else json.dumps(spec.body).encode()


def _has_output(chunk: dict[str, Any]) -> bool:
    for c in chunk.get("choices", ()):
        if c.get("text") or (c.get("delta") or {}).get("content") or c.get("token_ids"):
            return True
    return False


async def send(client: httpx.AsyncClient, spec: RequestSpec) -> Result:
    """Send one request and read its whole response (or its stream, up to cancel_after chunks)."""
    result = Result(spec, start=time.perf_counter())
    headers = {"Content-Type": "application/json"}
    try:
        async with client.stream("POST", spec.path, content=_content(spec), headers=headers) as response:
            result.status = response.status_code
            result.headers = dict(response.headers)
            if not (spec.stream and response.status_code == 200):
                raw = await response.aread()
                result.end = time.perf_counter()
                try:
                    result.body = json.loads(raw)
                except ValueError:
                    result.error = f"not JSON: {raw[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    result.done = True
                    break
                chunk = json.loads(data)
                result.chunks.append(chunk)
                if _has_output(chunk):
                    result.chunk_times.append(time.perf_counter())
                if spec.cancel_after is not None and len(result.chunks) >= spec.cancel_after:
                    result.cancelled = True
                    break  # leaving the block closes the connection mid-stream
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter()
    return result


async def run_load(
    url: str, specs: Sequence[RequestSpec], concurrency: int, timeout: float = 600.0
) -> tuple[list[Result], float]:
    """Send `specs` from `concurrency` clients, each taking the next spec when its last one ends.
    Returns the results in spec order and the wall time of the whole run."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(specs)):
        queue.put_nowait(i)
    results: list[Result | None] = [None] * len(specs)
    # idle connections are dropped well before a server's keep-alive timeout (uvicorn's is 5 s, as is
    # httpx's default expiry): reusing one the server is closing at that moment fails the request
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                results[i] = await send(client, specs[i])

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return [r for r in results if r is not None], wall


def run_load_processes(
    url: str, specs: Sequence[RequestSpec], concurrency: int, processes: int, timeout: float = 600.0
) -> tuple[list[Result], float, float]:
    """run_load from `processes` client processes at once (spec i in process i % processes, the
    clients shared out as evenly), so that the client's own Python is not what sets the pace: one
    process reading 128 streams spends ~0.9 of a core. Returns the results in spec order, the wall
    time from the common start to the last response, and the clients' CPU seconds per wall second."""
    if processes < 1 or processes > concurrency:
        raise ValueError(f"processes must be in 1..concurrency ({concurrency}), got {processes}")
    context = multiprocessing.get_context("spawn")
    shares = [list(range(k, len(specs), processes)) for k in range(processes)]
    clients = [concurrency // processes + (k < concurrency % processes) for k in range(processes)]
    pipes, children = [], []
    for share, count in zip(shares, clients, strict=True):
        ours, theirs = context.Pipe()
        child = context.Process(target=_client_process, args=(theirs, url, [specs[i] for i in share], count, timeout))
        child.start()
        theirs.close()
        pipes.append(ours)
        children.append(child)
    try:
        for pipe in pipes:
            pipe.recv()  # "ready": imported, about to wait for the start
        start = time.perf_counter() + 0.05  # CLOCK_MONOTONIC: the same clock in every process
        for pipe in pipes:
            pipe.send(start)
        results: list[Result | None] = [None] * len(specs)
        cpu = 0.0
        for share, pipe in zip(shares, pipes, strict=True):
            done, spent = pipe.recv()
            cpu += spent
            for i, result in zip(share, done, strict=True):
                results[i] = result
    finally:
        for child in children:
            child.join(timeout)
            if child.is_alive():
                child.kill()
    wall = max(r.end for r in results if r is not None) - start
    return [r for r in results if r is not None], wall, cpu / wall


def _client_process(pipe: Any, url: str, specs: list[RequestSpec], concurrency: int, timeout: float) -> None:
    pipe.send("ready")
    start = pipe.recv()
    time.sleep(max(0.0, start - time.perf_counter()))
    cpu = time.process_time()
    results, _ = asyncio.run(run_load(url, specs, concurrency, timeout))
    pipe.send((results, time.process_time() - cpu))


# --- summary -------------------------------------------------------------------------------------
def percentiles(values: Sequence[float], points: Sequence[int] = (50, 90, 99)) -> dict[str, float | None]:
    """mean and pN (linear interpolation) in milliseconds; None without values."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in points}}
    ordered = sorted(values)

    def at(p: float) -> float:
        k = (len(ordered) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": 1e3 * sum(ordered) / len(ordered), **{f"p{p}": 1e3 * at(p) for p in points}}


def summarize(results: Sequence[Result], wall: float, concurrency: int) -> dict[str, Any]:
    """One concurrency level's numbers: latencies in ms, output tokens per second over the wall time."""
    ok = [r for r in results if r.status == 200 and r.error is None and (r.done or not r.spec.stream)]
    tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.end - r.chunk_times[0]) / (r.output_tokens - 1) for r in ok if r.chunk_times and r.output_tokens > 1]
    statuses: dict[str, int] = {}
    for r in results:
        key = str(r.status) if r.error is None else "error"
        statuses[key] = statuses.get(key, 0) + 1
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "completed": len(ok),
        "statuses": statuses,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall if wall else None,
        "requests_per_s": len(ok) / wall if wall else None,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([gap for r in ok for gap in r.itl]),
        "e2e_ms": percentiles([r.end - r.start for r in ok]),
    }


def random_token_specs(
    count: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    rng: random.Random,
    model: str | None = None,
    prefix: Sequence[int] = (),
) -> list[RequestSpec]:
    """Streamed completions of random token-id prompts that generate exactly output_len tokens; each
    prompt is `prefix` (shared by all: a system prompt) followed by input_len random tokens."""
    specs = []
    for _ in range(count):
        body: dict[str, Any] = {
            "prompt": [*prefix, *(rng.randrange(vocab_size) for _ in range(input_len))],
            "max_tokens": output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if model is not None:
            body["model"] = model
        specs.append(RequestSpec(COMPLETIONS, body))
    return specs


def _line(s: dict[str, Any]) -> str:
    def ms(d: dict[str, Any], key: str) -> str:
        return "-" if d[key] is None else f"{d[key]:.1f}"

    return (
        f"c={s['concurrency']:<4} ok {s['completed']}/{s['requests']}  {s['output_tokens_per_s']:.1f} tok/s  "
        f"TTFT p50 {ms(s['ttft_ms'], 'p50')} p99 {ms(s['ttft_ms'], 'p99')} ms  "
        f"TPOT p50 {ms(s['tpot_ms'], 'p50')} p99 {ms(s['tpot_ms'], 'p99')} ms  "
        f"ITL p50 {ms(s['itl_ms'], 'p50')} p99 {ms(s['itl_ms'], 'p99')} ms"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="Server root (default %(default)s).")
    parser.add_argument("--concurrency", default="1,8,32,64,128", help="Comma-separated client counts.")
    parser.add_argument("--input-len", type=int, default=128, help="Prompt tokens per request.")
    parser.add_argument("--output-len", type=int, default=128, help="Generated tokens per request (ignore_eos).")
    parser.add_argument("--num-prompts", type=int, default=256, help="Requests per concurrency level.")
    parser.add_argument("--vocab-size", type=int, default=500, help="Prompt token ids are drawn below this.")
    parser.add_argument("--model", help="The `model` to send (default: the server's first /v1/models entry).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="Write the results as JSON here.")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    model = args.model or httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
    rng = random.Random(args.seed)
    runs = []
    for concurrency in levels:
        specs = random_token_specs(args.num_prompts, args.input_len, args.output_len, args.vocab_size, rng, model)
        results, wall = asyncio.run(run_load(args.url, specs, concurrency))
        summary = summarize(results, wall, concurrency)
        print(_line(summary), flush=True)
        runs.append(summary)
    if args.out is not None:
        sys.path.insert(0, str(Path(__file__).parent))
        from compile_bench import report_header

        report = {
            **report_header("loadgen"),
            "url": args.url,
            "model": model,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_prompts": args.num_prompts,
            "levels": runs,
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
