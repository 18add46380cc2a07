"""Next-token choice from logits: greedy, or temperature / top-k / top-p sampling with per-request RNGs,
for a whole batch at once on the device (a handful of batched ops, whatever the batch size; one random
draw per distinct generator), with no host sync: the tokens stay on the device for the next step and
the host reads them later (SampledTokens).

Numerically safe for every SamplingParams that validates: a temperature below SAMPLING_EPS is greedy,
one above MAX_TEMPERATURE counts as it, logits are shifted so that each row's maximum is 0 before the
division by the temperature (so nothing overflows, whatever the spread and the temperature), and
top_p is at least MIN_TOP_P, so the top-ranked token always survives the cuts and the distribution is
never empty or NaN. A row whose logits hold a NaN or +inf, or are all -inf (a model fault), gets
None: the engine fails that request alone (its device token is the argmax, a valid id, so the step
launched after it runs). A -inf beside finite logits is a masked token, as usual.

Before all that, each row's logit_bias is added and its `banned` tokens (the engine's: EOS and stop
token ids before min_tokens) set to -inf, for the rows that have any, in two batched writes on an
fp32 copy of the logits.

The draw is the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with probability
p_i (the Gumbel-max trick), so sampled rows need no multinomial per row. p is taken unnormalised
(exp of the tempered logits, the row's maximum at 0): the argmax is the same, and a rank of a
tensor-parallel engine that holds some of the vocabulary's columns computes its share of the race
alone (engine/sharded_sampler.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qruntime.engine.sampled_tokens import SampledTokens
from qruntime.engine.sampling_params import SamplingParams
from qruntime.engine.transfer import device_tensor

# larger temperatures act as this one: it already flattens any logit spread below 1e25 to uniform
MAX_TEMPERATURE = 1e30
# smaller top_p act as this one (it keeps only the best token, as any top_p below it does): a top_p
# that rounds to 0 in fp32 would make `mass before >= top_p` true for the best token too and drop it
MIN_TOP_P = 1e-30


def top_k_values(scaled: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest values of each row of scaled [n, V], descending (tp > 1 merges the ranks' own)."""
    return torch.topk(scaled, k, dim=-1).values


def log_weights(
    logits: torch.Tensor,
    best: torch.Tensor,
    params: Sequence[SamplingParams],
    vocab: int | None = None,
    top_values=top_k_values,
) -> torch.Tensor:
    """The rows' tempered, cut log-weights [n, V] fp32: (logit - best) / temperature, where the row's
    maximum is 0 and a cut token is -inf (min_p, top_k, top_p). exp() of them are the row's
    probabilities times a constant of the row, which the race (argmax of weight / E) does not need.

    `best` [n]: each row's maximum over the whole vocabulary; `vocab`: its size when `logits` holds
    only some of its columns (a rank's shard: then `top_values` merges the ranks' largest values, and
    top_p, which needs the whole sorted row, is not taken)."""
    device, vocab = logits.device, vocab or logits.shape[1]
    temperature = device_tensor([min(p.temperature, MAX_TEMPERATURE) for p in params], torch.float32, device)
    finite = torch.isfinite(best)
    shift = torch.where(finite, best.float(), torch.zeros_like(best, dtype=torch.float32))
    scaled = (logits.float() - shift[:, None]).div_(temperature[:, None])  # each row's maximum is 0
    scaled = torch.where(finite[:, None], scaled, torch.zeros_like(scaled))  # a faulty row: uniform, not NaN
    if any(p.min_p > 0 for p in params):  # p_i < min_p * p_max  <=>  scaled_i < log(min_p) (the row's max is 0)
        floor = device_tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], torch.float32, device)
        scaled = torch.where(scaled < floor[:, None], float("-inf"), scaled)
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        k = device_tensor(top_k, torch.int64, device)
        values = top_values(scaled, max(top_k))
        kth = values.gather(1, (k - 1).clamp_(min=0)[:, None])
        scaled = torch.where((k[:, None] > 0) & (scaled < kth), float("-inf"), scaled)
    top_p = [max(p.top_p, MIN_TOP_P) for p in params]
    if any(p < 1.0 for p in top_p):
        if vocab != logits.shape[1]:
            raise ValueError("top_p needs each row's whole vocabulary, and these logits are a shard of it")
        ordered, order = torch.sort(scaled, dim=-1, descending=True)
        probs = ordered.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass (never the first)
        cut = device_tensor(top_p, torch.float32, device)[:, None]
        drop = ((probs.cumsum(-1) - probs) >= cut) & (cut < 1.0)
        scaled = scaled.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    return scaled


def race(weights: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """exp(weights) / draws [n, V], in weights' memory (draws: Exp(1)): its argmax is the row's sampled
    token. The weights are at most 0, so exp() never overflows, and the draws are at least fp32's tiny."""
    return weights.exp_().div_(draws)


def exponentials(shape: tuple[int, int], generators: Sequence[torch.Generator], device: torch.device) -> torch.Tensor:
    """Exp(1) draws [n, V]: rows that share a generator draw together, in row order (one op each).
    A rank of a tensor-parallel engine draws the whole rows too and keeps its columns: the same
    numbers as tp=1 (sharded_sampler)."""
    groups: dict[int, list[int]] = {}
    for row, generator in enumerate(generators):
        groups.setdefault(id(generator), []).append(row)
    if len(groups) == 1:  # the usual case (requests without a seed share the engine's generator)
        draws = torch.empty(shape, device=device).exponential_(generator=generators[0])
    else:
        draws = torch.empty(shape, device=device)
        for members in groups.values():
            block = torch.empty(len(members), shape[1], device=device).exponential_(generator=generators[members[0]])
            draws[device_tensor(members, torch.int64, device)] = block
    return draws.clamp_(min=torch.finfo(torch.float32).tiny)  # an exact 0 would make 0 / 0 = NaN


@dataclass(frozen=True)
class History:
    """What a penalized row has seen: its prompt's ids, its output ids the host knows, and the row of
    the step in flight's sampled ids that holds its newest output (None: it has none in flight)."""

    prompt: Sequence[int]
    outputs: Sequence[int]
    in_flight_row: int | None = None


def penalized(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[History | None],
    in_flight: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [n, V] fp32 with each penalized row's presence, frequency and repetition penalties
    applied (SamplingParams says how), in place; `in_flight`: the sampled ids [m] on the device that
    the histories' in_flight_row name (never read on the host). Batched: a count of each row's
    outputs built by one scatter, whatever the batch."""
    rows = [r for r, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]

    def scatter(target: torch.Tensor, pairs: tuple[list[int], list[int]], value: float) -> None:
        if pairs[0]:
            at = device_tensor(pairs, torch.int64, device)
            target.index_put_((at[0], at[1]), torch.full((), value, device=device, dtype=target.dtype), accumulate=True)

    counts = torch.zeros(len(rows), vocab, device=device)
    known: tuple[list[int], list[int]] = ([], [])
    for k, row in enumerate(rows):
        known[0].extend([k] * len(histories[row].outputs))
        known[1].extend(histories[row].outputs)
    scatter(counts, known, 1.0)
    flying = [
        (k, histories[row].in_flight_row) for k, row in enumerate(rows) if histories[row].in_flight_row is not None
    ]
    if flying:
        ks, at = device_tensor([[k for k, _ in flying], [f for _, f in flying]], torch.int64, device)
        counts.index_put_((ks, in_flight[at]), torch.ones(len(flying), device=device), accumulate=True)
    index = device_tensor(rows, torch.int64, device)
    picked = logits[index]

    def column(name: str) -> torch.Tensor:
        """A penalty of each penalized row, as a column [rows, 1]."""
        return device_tensor([getattr(params[r], name) for r in rows], torch.float32, device)[:, None]

    if any(params[r].repetition_penalty != 1 for r in rows):
        seen = (counts > 0).float()
        prompt: tuple[list[int], list[int]] = ([], [])
        for k, row in enumerate(rows):
            prompt[0].extend([k] * len(histories[row].prompt))
            prompt[1].extend(histories[row].prompt)
        scatter(seen, prompt, 1.0)
        penalty = column("repetition_penalty")
        scaled = torch.where(picked > 0, picked / penalty, picked * penalty)
        picked = torch.where(seen > 0, scaled, picked)
    picked = picked - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0)
    logits[index] = picked
    return logits


def _adjusted(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    banned: Sequence[Sequence[int]] | None,
    histories: Sequence[History | None] | None = None,
    in_flight: torch.Tensor | None = None,
    allowed: tuple[Sequence[int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """logits with each row's logit_bias added, its penalties applied, its banned tokens at -inf and,
    for the rows of `allowed` (rows, int32 bitmask [len(rows), ceil(V / 32)] on the device: bit j of
    word w allows token 32 w + j), every token the mask does not allow at -inf (fp32); or as they are."""
    penalties = histories is not None and any(p.penalized for p in params)
    rows, tokens, biases, ban_rows, ban_tokens = [], [], [], [], []
    for row, p in enumerate(params):
        for token, bias in p.logit_bias:
            rows.append(row)
            tokens.append(token)
            biases.append(bias)
        for token in banned[row] if banned is not None else ():
            ban_rows.append(row)
            ban_tokens.append(token)
    if not (rows or ban_rows or penalties or allowed):
        return logits
    out, device = logits.to(torch.float32, copy=True), logits.device  # never the caller's (a captured graph's output)
    if rows:
        at = device_tensor([rows, tokens], torch.int64, device)
        out.index_put_((at[0], at[1]), device_tensor(biases, torch.float32, device), accumulate=True)
    if penalties:
        out = penalized(out, params, histories, in_flight)
    if ban_rows:
        at = device_tensor([ban_rows, ban_tokens], torch.int64, device)
        out.index_put_((at[0], at[1]), torch.full((), float("-inf"), device=device))
    if allowed:
        masked, words = allowed
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        bits = ((words[:, :, None] >> shifts) & 1).reshape(len(masked), -1)[:, : out.shape[1]].bool()
        at = device_tensor(list(masked), torch.int64, device)
        out[at] = torch.where(bits, out[at], float("-inf"))
    return out


@dataclass(frozen=True)
class Forced:
    """Rows whose token is `token` whatever was sampled: those of `always`, and those of `unless`
    (row, in-flight row) whose token in flight (in_flight[in-flight row], still on the device) is
    not `unless_token`, and those of `when` (row, in-flight row) whose token in flight is
    `when_token`. The conditions are decided on the device: the host does not know those tokens yet."""

    token: int
    always: tuple[int, ...] = ()
    unless: tuple[tuple[int, int], ...] = ()
    unless_token: int = -1
    when: tuple[tuple[int, int], ...] = ()
    when_token: int = -1


def apply_forced(index: torch.Tensor, forced: Forced, in_flight: torch.Tensor | None) -> torch.Tensor:
    """index with the forced rows' token put in (Forced says which), on the device."""
    device = index.device
    rows = [*forced.always, *(r for r, _ in forced.unless), *(r for r, _ in forced.when)]
    if not rows:
        return index
    if (forced.unless or forced.when) and in_flight is None:
        raise ValueError("a forced row's condition reads the token in flight, and none is")
    apply = torch.ones(len(rows), dtype=torch.bool, device=device)
    if forced.unless or forced.when:
        start = len(forced.always)
        flying = device_tensor([f for _, f in (*forced.unless, *forced.when)], torch.int64, device)
        previous = in_flight[flying]
        wanted = torch.cat(
            [previous[: len(forced.unless)] != forced.unless_token, previous[len(forced.unless) :] == forced.when_token]
        )
        apply[start:] = wanted
    at = device_tensor(rows, torch.int64, device)
    return index.index_put((at,), torch.where(apply, forced.token, index[at]))


def sample_on_device(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    banned: Sequence[Sequence[int]] | None = None,
    histories: Sequence[History | None] | None = None,
    in_flight: torch.Tensor | None = None,
    forced: Forced | None = None,
    allowed: tuple[Sequence[int], torch.Tensor] | None = None,
) -> SampledTokens:
    """One token per row of logits [n, V]; row i uses params[i] and generators[i] (None for greedy),
        cannot be any token of banned[i], and is penalized by histories[i] (`penalized`), on the device,
        without waiting for it. `forced` rows get its token instead (the engine's thinking cap); the rows of
    `allowed` sample only tokens their mask allows (structured output: `_adjusted`)."""
    logits = _adjusted(logits, params, banned, histories, in_flight, allowed)
    best, index = logits.max(-1)  # NaN propagates into best: one reduction finds NaN, +inf and all -inf rows
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        rows = device_tensor(sampled, torch.int64, logits.device) if len(sampled) < len(params) else None
        picked = logits if rows is None else logits[rows]
        weights = log_weights(picked, best if rows is None else best[rows], [params[i] for i in sampled])
        draws = exponentials(tuple(weights.shape), [generators[i] for i in sampled], logits.device)
        drawn = race(weights, draws).argmax(-1)
        index = drawn if rows is None else index.index_copy(0, rows, drawn)
    if forced is not None:
        index = apply_forced(index, forced, in_flight)
    return SampledTokens(index, best)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    banned: Sequence[Sequence[int]] | None = None,
    histories: Sequence[History | None] | None = None,
    in_flight: torch.Tensor | None = None,
) -> list[int | None]:
    """`sample_on_device`, read on the host: one token per row, None for a row whose logits hold a
    NaN or +inf, or are all -inf."""
    return sample_on_device(logits, params, generators, banned, histories, in_flight).tolist()
