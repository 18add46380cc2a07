"""A cap on a reasoning model's thinking (SamplingParams.max_thinking_tokens): where each capped
request's <think> block stands, and whether the token a step samples for it must be </think>.

The host knows a request's tokens up to the step before the one in flight (async scheduling): the
token in flight is still on the device. So the state here follows the known tokens, and `mode`
says how the step being launched forces its token given that one unknown token: always, unless the
token in flight closes the block (then the block is already closed), or only when the token in
flight opens one (a cap of 0). The sampler decides the last two on the device (sampler.Forced).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(eq=False)
class ThinkingState:
    """A capped request's <think> block, from the tokens the host knows."""

    cap: int
    open_id: int
    close_id: int
    open: bool  # a <think> is open: its tokens count towards the cap
    count: int = 0  # tokens generated inside the open block

    @classmethod
    def of_prompt(cls, cap: int, open_id: int, close_id: int, prompt: Sequence[int]) -> ThinkingState:
        """The state a prompt leaves: open when its last <think> comes after its last </think>."""
        last = {open_id: -1, close_id: -1}
        for position, token in enumerate(prompt):
            if token in last:
                last[token] = position
        return cls(cap, open_id, close_id, last[open_id] > last[close_id])

    def observe(self, token: int) -> None:
        """A generated token, in order."""
        if not self.open:
            if token == self.open_id:
                self.open, self.count = True, 0
        elif token == self.close_id:
            self.open = False
        else:
            self.count += 1  # a <think> inside the block is a thinking token too

    def mode(self, in_flight: bool) -> str | None:
        """How the next token sampled is forced to </think>: "always", "unless" (unless the token in
        flight is </think>), "when" (when the token in flight is <think>), or None; `in_flight`:
        whether the request has a token in flight, unknown here."""
        if not in_flight:
            return "always" if self.open and self.count >= self.cap else None
        if self.open:
            return "unless" if self.count + 1 >= self.cap else None
        return "when" if self.cap == 0 else None
