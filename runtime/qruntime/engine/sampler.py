"""Next-token choice from logits: greedy, or temperature / top-k / top-p sampling with per-request RNGs.

Numerically safe for every SamplingParams that validates: the logits are shifted so their maximum is
0 before the temperature divides them (no overflow however small the temperature; a temperature
below SAMPLING_EPS is greedy, one above MAX_TEMPERATURE counts as it), the top-ranked token always
survives the top-k / top-p cuts (so a top_p that rounds to 0 in fp32 keeps one token), and the
distribution is therefore never empty or NaN. A row whose logits hold a NaN or +inf, or are all
-inf (a model fault), gets None: the engine fails that request alone. A -inf beside finite logits
is a masked token, as usual.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qruntime.engine.sampling_params import SamplingParams

# larger temperatures act as this one: it already flattens any logit spread below 1e25 to uniform, and
# stays inside fp32, where a temperature of inf would turn a masked token's -inf / inf into NaN
MAX_TEMPERATURE = 1e30


def _distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [V] fp32 from logits [V] fp32 with a finite maximum: temperature, then the cuts."""
    scaled = (logits - logits.max()) / min(params.temperature, MAX_TEMPERATURE)  # <= 0, the best token exactly 0
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scaled, descending=True)
        probs = ordered.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass; never the first
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        drop[0] = False
        scaled = scaled.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
    return scaled.softmax(-1)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int | None]:
    """One token per row of logits [n, V]; row i uses params[i] and generators[i] (None for greedy).

    None for a row whose logits hold a NaN or +inf, or are all -inf."""
    logits = logits.float()
    # amax propagates NaN, so one reduction finds NaN, +inf and all -inf rows; one sync for both lists
    greedy, finite = torch.stack([logits.argmax(-1), torch.isfinite(logits.amax(-1)).long()]).tolist()
    tokens: list[int | None] = []
    for i, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not finite[i]:
            tokens.append(None)
        elif p.greedy:
            tokens.append(greedy[i])
        else:
            tokens.append(int(torch.multinomial(_distribution(logits[i], p), 1, generator=gen)))
    return tokens
