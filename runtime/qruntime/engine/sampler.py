"""Next-token choice from logits: greedy, or temperature / top-k / top-p sampling with per-request RNGs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qruntime.engine.sampling_params import SamplingParams


def _filtered(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] fp32 scaled by temperature, with tokens outside top-k / top-p set to -inf."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        probs = ordered.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        logits = logits.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
    return logits


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """One token per row of logits [n, V]; row i uses params[i] and generators[i] (None for greedy)."""
    logits = logits.float()
    tokens = logits.argmax(-1).tolist()
    for i, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            probs = _filtered(logits[i], p).softmax(-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=gen))
    return tokens
