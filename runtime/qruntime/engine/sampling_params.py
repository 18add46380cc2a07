"""How to pick each next token and when to stop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (as vLLM): dividing by them only rounds to argmax


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping.

    temperature 0 (or anything below SAMPLING_EPS) is greedy (top_k / top_p / seed are then unused). top_k 0 means no top-k cut,
    top_p 1.0 no nucleus cut. `seed` makes a sampled generation reproducible (whatever else runs in
    the same batch). Generation stops at the first of: max_tokens new tokens; a stop token id; an
    EOS id of the model (unless ignore_eos); a stop string (not part of the text); the model's
    context length.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        problems = []
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            problems.append(f"max_tokens must be a positive integer (got {self.max_tokens!r})")
        if not isinstance(self.temperature, int | float) or not 0 <= self.temperature < float("inf"):
            problems.append(f"temperature must be a finite number >= 0 (got {self.temperature!r})")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be an integer >= 0, 0 = off (got {self.top_k!r})")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1] (got {self.top_p!r})")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            problems.append(f"seed must be a non-negative integer (got {self.seed!r})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append(f"stop strings must be non-empty strings (got {list(self.stop)!r})")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must be non-negative integers (got {list(self.stop_token_ids)!r})")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def as_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt (a single one is shared)."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"{len(params)} SamplingParams for {count} prompts")
    return params
