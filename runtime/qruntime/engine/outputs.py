"""What the engine hands back: finished requests, streamed deltas, timings, request errors."""

from __future__ import annotations

from dataclasses import dataclass, replace


class InvalidRequest(ValueError):
    """A request the engine refuses (empty prompt, too long, unknown token id, bad parameters).

    Raised when the request is added; nothing else in the engine is affected."""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token, its logprob, and the likeliest tokens at its position with theirs, best first
    (engine/logprobs.py says which logits they come from)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 + how many tokens of the vocabulary have a higher logprob (vLLM's rank)


@dataclass(frozen=True)
class Timings:
    """Wall-clock seconds (time.perf_counter) of a request's life."""

    arrival: float
    first_token: float | None
    finished: float | None
    num_output_tokens: int

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival -> first token sampled."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (mean inter-token time)."""
        if self.finished is None or self.first_token is None or self.num_output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.num_output_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


@dataclass(frozen=True)
class RequestOutput:
    """A finished request. finish_reason: "stop" (EOS, stop token or stop string; stop_reason says
    which), "length" (max_tokens or the context length), "abort", or "error": the engine could not
    run this request on (`error` says what failed; the cause is in the engine's log under its id)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    stop_reason: str | int | None
    timings: Timings
    num_preemptions: int
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held when it was first admitted (usage's cached_tokens)
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token_ids entry, when SamplingParams.logprobs asked
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # one per prompt token (the first: None)

    def stopped_at(self, num_tokens: int, stop: str, text: str = "") -> RequestOutput:
        """This output as if it had ended at stop string `stop`, completed by its token num_tokens - 1:
        the tokens after it dropped (sampled while the text was turned out elsewhere), finish_reason
        "stop", `text` the text before the stop string."""
        return replace(
            self,
            token_ids=self.token_ids[:num_tokens],
            logprobs=None if self.logprobs is None else self.logprobs[:num_tokens],
            text=text,
            finish_reason="stop",
            stop_reason=stop,
            timings=replace(self.timings, num_output_tokens=min(num_tokens, self.timings.num_output_tokens)),
        )


@dataclass(frozen=True)
class StreamDelta:
    """New tokens of one request since the last delta; `output` is set on the last one."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    output: RequestOutput | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # of token_ids, when the request asked for logprobs
