"""Next-token choice from logits: greedy, or temperature / top-k / top-p sampling with per-request RNGs.

Numerically safe for every SamplingParams that validates: a temperature below SAMPLING_EPS is greedy,
one above MAX_TEMPERATURE counts as it, logits whose maximum would overflow fp32 once divided by the
temperature are shifted to a maximum of 0 first (a host-side test, so sane logits pay no extra op),
and top_p is at least MIN_TOP_P, so the top-ranked token always survives the cuts and the
distribution is never empty or NaN. A row whose logits hold a NaN or +inf,
or are all -inf (a model fault), gets None: the engine fails that request alone. A -inf beside finite
logits is a masked token, as usual.

The check costs the hot path little: one max over the vocabulary gives the greedy token and, through
NaN propagation, whether the row is finite; both lists are read by the host (two small copies cost
less than any device op to combine them: on an H100 host each torch op is ~20 us of dispatch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from qruntime.engine.sampled_tokens import SampledTokens
from qruntime.engine.sampling_params import SamplingParams

# larger temperatures act as this one: it already flattens any logit spread below 1e25 to uniform, and
# stays inside fp32, where a temperature of inf would turn a masked token's -inf / inf into NaN
MAX_TEMPERATURE = 1e30
# smaller top_p act as this one (it keeps only the best token, as any top_p below it does): a top_p
# that rounds to 0 in fp32 would make `mass before >= top_p` true for the best token too and drop it
MIN_TOP_P = 1e-30
FP32_SAFE = 1e37  # below fp32's largest value (3.4e38) with room for softmax's sums


def _distribution(logits: torch.Tensor, peak: float, params: SamplingParams) -> torch.Tensor:
    """Probabilities [V] fp32 from logits [V] fp32 whose maximum `peak` is finite: temperature, then the cuts."""
    temperature = min(params.temperature, MAX_TEMPERATURE)
    # softmax shifts by the maximum itself; logits that would overflow once divided are shifted to <= 0 first
    scaled = logits / temperature if abs(peak) / temperature < FP32_SAFE else (logits - peak).div_(temperature)
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scaled, descending=True)
        probs = ordered.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass (never the first: 0 < top_p)
        drop = (probs.cumsum(-1) - probs) >= max(params.top_p, MIN_TOP_P)
        scaled = scaled.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
    return scaled.softmax(-1)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int | None]:
    """One token per row of logits [n, V]; row i uses params[i] and generators[i] (None for greedy).

    None for a row whose logits hold a NaN or +inf, or are all -inf."""
    best, index = logits.max(-1)  # NaN propagates into best: one reduction finds NaN, +inf and all -inf rows
    peaks, chosen = best.tolist(), index.tolist()
    wide = logits.float() if not all(p.greedy for p in params) else None  # one cast for every sampled row
    tokens: list[int | None] = []
    for i, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not math.isfinite(peaks[i]):
            tokens.append(None)
        elif p.greedy:
            tokens.append(chosen[i])
        else:
            tokens.append(int(torch.multinomial(_distribution(wide[i], peaks[i], p), 1, generator=gen)))
    return tokens


def sample_on_device(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> SampledTokens:
    """`sample` without waiting for the device when every row is greedy: the argmax stays on the
    device for the next step and the host reads it later (SampledTokens.tolist). A batch with a
    sampled row goes through `sample` (its host-side checks need the logits' maxima first), then
    its tokens go back to the device."""
    if all(p.greedy for p in params):
        best, index = logits.max(-1)
        return SampledTokens(index, best)
    return SampledTokens.of(sample(logits, params, generators), logits.device)
