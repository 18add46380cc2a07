"""GET /metrics: Prometheus text from a registry of the server's own (no process-global state).

Gauges are read from the engine loop's snapshot at scrape time; histograms and counters are fed by
the engine thread as requests add, generate and finish (prometheus_client's metrics are thread-safe).
The prefix cache's counters are the engine's own, read at scrape time (an immutable value the engine
thread replaces, so the two always agree); so are speculative decoding's (qruntime_spec_decode_*),
which a server that does not speculate leaves out altogether: a dashboard then reads "off", not an
acceptance rate of 0.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from qruntime.engine.outputs import RequestOutput
from qruntime.engine.prefix_cache import PrefixCacheStats
from qruntime.engine.speculative.speculator import SpeculativeStats
from qruntime.serve.engine_loop import LoopStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
RATE_WINDOW_S = 10.0  # generation_tokens_per_second averages over this many recent seconds


class _PrefixCacheCollector(Collector):
    def __init__(self, stats: Callable[[], PrefixCacheStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield CounterMetricFamily(
            "qruntime_prefix_cache_queries",
            "Tokens looked up in the prefix cache as sequences are admitted (prompts; prompt + output after a "
            "preemption). Stays 0 with --no-prefix-cache.",
            s.queries,
        )
        yield CounterMetricFamily(
            "qruntime_prefix_cache_hits", "Of the tokens looked up, those whose KV came from the cache.", s.hits
        )
        yield GaugeMetricFamily(
            "qruntime_prefix_cache_hit_rate",
            "prefix_cache_hits / prefix_cache_queries since start (0 before any).",
            s.hit_rate,
        )


class _SpeculativeCollector(Collector):
    def __init__(self, stats: Callable[[], SpeculativeStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if s is None:  # not speculating: no series at all (see the module docstring)
            return
        yield CounterMetricFamily(
            "qruntime_spec_decode_draft_tokens", "Draft tokens proposed and verified (--speculative).", s.drafted
        )
        yield CounterMetricFamily(
            "qruntime_spec_decode_accepted_tokens", "Of the draft tokens verified, those accepted.", s.accepted
        )
        yield CounterMetricFamily(
            "qruntime_spec_decode_verifications",
            "Verifications: one sequence's drafts checked in one engine step.",
            s.verifications,
        )
        yield CounterMetricFamily(
            "qruntime_spec_decode_emitted_tokens",
            "Tokens the verifications emitted (accepted drafts plus the one each adds, after stops).",
            s.emitted,
        )
        yield GaugeMetricFamily(
            "qruntime_spec_decode_acceptance_rate",
            "spec_decode_accepted_tokens / spec_decode_draft_tokens since start (0 before any).",
            s.acceptance_rate,
        )
        yield GaugeMetricFamily(
            "qruntime_spec_decode_tokens_per_verification",
            "spec_decode_emitted_tokens / spec_decode_verifications since start (0 before any).",
            s.tokens_per_verification,
        )


class _LoopCollector(Collector):
    def __init__(self, stats: Callable[[], LoopStats], rate: Callable[[], float]) -> None:
        self._stats, self._rate = stats, rate

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily(
            "qruntime_num_requests_waiting",
            "Sequences accepted and waiting for admission (the bounded queue).",
            s.num_waiting,
        )
        yield GaugeMetricFamily(
            "qruntime_num_requests_running", "Sequences admitted by the scheduler (holding KV blocks).", s.num_running
        )
        yield GaugeMetricFamily("qruntime_kv_cache_blocks_used", "KV-cache blocks held by sequences.", s.kv_blocks_used)
        yield GaugeMetricFamily(
            "qruntime_kv_cache_blocks_total", "KV-cache blocks the scheduler hands out.", s.kv_blocks_total
        )
        yield GaugeMetricFamily("qruntime_engine_alive", "1 while the engine thread runs.", int(s.alive))
        yield GaugeMetricFamily(
            "qruntime_generation_tokens_per_second",
            f"Output tokens per second over the last {RATE_WINDOW_S:g} s.",
            self._rate(),
        )


class Metrics:
    """The server's metrics; `render()` is the /metrics body."""

    def __init__(
        self,
        stats: Callable[[], LoopStats],
        prefix_cache: Callable[[], PrefixCacheStats] = PrefixCacheStats,
        speculative: Callable[[], SpeculativeStats | None] = lambda: None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "qruntime_time_to_first_token_seconds",
            "Request received -> first token sampled.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "qruntime_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "qruntime_e2e_request_latency_seconds", "Request received -> finished.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.generation_tokens = Counter("qruntime_generation_tokens", "Output tokens generated.", registry=r)
        self.prompt_tokens = Counter("qruntime_prompt_tokens", "Prompt tokens of accepted sequences.", registry=r)
        self.finished = Counter(
            "qruntime_request_success", "Sequences finished, by finish_reason.", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "qruntime_requests_rejected", "HTTP requests refused, by status code.", ["status"], registry=r
        )
        self.images = Counter(
            "qruntime_request_images",
            "Images in accepted chat requests (a Qwen3-VL model's; each counted once, whatever n).",
            registry=r,
        )
        self.batch_size = Histogram(
            "qruntime_batch_size", "Sequences that got a token in one engine step.", buckets=BATCH_BUCKETS, registry=r
        )
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        r.register(_LoopCollector(stats, self.tokens_per_second))
        r.register(_PrefixCacheCollector(prefix_cache))
        r.register(_SpeculativeCollector(speculative))

    # --- fed by the engine thread (serve.engine_loop.LoopMetrics) -------------------------------------
    def on_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_step(self, num_sequences: int, num_tokens: int) -> None:
        self.batch_size.observe(num_sequences)
        self.generation_tokens.inc(num_tokens)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, num_tokens))
            self._trim(now)

    def on_finished(self, output: RequestOutput, submitted: float) -> None:
        t = output.timings
        self.finished.labels(output.finish_reason).inc()
        if t.first_token is not None:
            self.ttft.observe(t.first_token - submitted)
        if t.tpot is not None and output.finish_reason != "abort":
            self.tpot.observe(t.tpot)
        if t.finished is not None and output.finish_reason != "abort":
            self.e2e.observe(t.finished - submitted)

    # --- read by the HTTP side ----------------------------------------------------------------------
    def on_rejected(self, status: int) -> None:
        self.rejected.labels(str(status)).inc()

    def on_images(self, count: int) -> None:
        self.images.inc(count)

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
