"""A generation request's token state, as the scheduler sees it (plain Python: no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    """Where a request is: waiting for admission, running (holds KV blocks), or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: two requests with equal tokens are still two requests
class Request:
    """One generation request's token state as the scheduler sees it."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # most new tokens to generate (> 0)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens (prompt + output) whose KV is in the cache, or is being computed
    num_pending: int = 0  # tokens sampled on the device whose ids the host does not know yet (0 to 2)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    num_cached_prompt_tokens: int | None = None  # prompt tokens whose KV the prefix cache had at first admission
    reuse_cached: bool = True  # False: computes every prompt token (its prompt logprobs need each position's logits)
    # Qwen3-VL: (prompt position of an image's first token, digest of its pixels) per image, which the
    # prefix cache's hash chain takes in at that block: every image token has the same id
    image_keys: tuple[tuple[int, bytes], ...] = ()

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """len(prompt) + len(output)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)
