"""Sampling from a vocabulary-parallel lm_head without gathering the logits: each rank holds the
logits of its V/tp columns (its plan ends before the graph's AllGather: qruntime.rank), and the
ranks choose every row's token together by exchanging a few numbers per row.

Why it is exact. The sampler's choice is an argmax over the vocabulary: of the adjusted logits for
a greedy row, of exp(log-weight) / E for a sampled one (sampler.race). An argmax over the vocabulary
is the best of the ranks' argmaxes over their columns (ties to the lower rank, i.e. the lower id,
as torch's argmax does), and every input of it is computed column by column except three: the row's
maximum (the ranks' maxima merged), top_k's k-th value (the ranks' k largest merged) and the Exp(1)
draws, which every rank takes over the whole row from the generator states rank 0 sends with the
step, keeping its columns: the numbers tp=1 draws. So from the same logits a greedy or seeded row
gets exactly tp=1's token.

What the ranks need comes with the step as plain data (ShardedSampling): each row's temperature,
top_k and min_p, its logit biases and banned tokens, and the state of each generator it draws from.
top_p (its cut needs the whole sorted row), penalties, structured output, logprobs and prompt
logprobs are not sharded: a step with any of them gathers the logits (`gather_logits`) and rank 0
samples them as tp=1 does.

Exchanges per step (VocabShard.exchange: the custom all-reduce's one-shot kernel where the engine
has peer memory, else an NCCL / gloo all-gather): each rank's (value, index) per row; with sampled
rows, the rows' maxima first; with top_k, the rows' k largest values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from qruntime.engine.sampler import Forced, apply_forced, exponentials, log_weights, race
from qruntime.engine.sampling_params import SamplingParams
from qruntime.engine.transfer import device_tensor
from qruntime.kernels import kernel_runs_on
from qruntime.ops.collective import all_gather_columns, all_gather_rows

MAX_SHARDED_VOCAB = 1 << 24  # token ids travel as fp32 beside their values: exact below 2^24


@dataclass(frozen=True)
class VocabShard:
    """This rank's share of the vocabulary: columns [rank * n, (rank + 1) * n) of every logits row,
    n = V / world; `group` is the tensor-parallel process group, `reducer` its all-reduce over peer
    memory when the engine has one (qruntime.comm: the exchanges then take its one-shot kernel,
    which also stops waiting when a worker dies, where an NCCL call can leave rank 0 blocked)."""

    rank: int
    world: int
    group: Any
    reducer: Any = None

    def exchange_stacked(self, stacked: torch.Tensor) -> torch.Tensor:
        """Every rank's row of `stacked` [world, ...] (its own row filled, zeros elsewhere), in rank
        order: summed in place by the reducer, else all-gathered."""
        if self.reducer is not None and self.reducer.kernel(stacked) is not None:
            return self.reducer.all_reduce(stacked)
        return all_gather_rows(stacked[self.rank], self.group)

    def exchange(self, x: torch.Tensor) -> torch.Tensor:
        """[world, *x.shape]: every rank's x (fp32, the same shape on each) in rank order. Through the
        reducer, a sum of [world, ...] buffers that are zero but for each rank's own row: exact."""
        if self.reducer is None:
            return all_gather_rows(x, self.group)
        stacked = torch.zeros((self.world, *x.shape), dtype=x.dtype, device=x.device)
        stacked[self.rank] = x
        return self.exchange_stacked(stacked)


class Rule(NamedTuple):
    """A sampled row's rule (sampler.log_weights reads it as it reads SamplingParams)."""

    temperature: float
    top_k: int
    min_p: float

    @property
    def top_p(self) -> float:
        return 1.0


@dataclass(frozen=True)
class ShardedSampling:
    """A step's sampling, as every rank needs it (pickled with the step once for all workers).

    `rows`: the logits rows that sample (None: every row), in the order of the tokens returned;
    `rules`: per such row, None for a greedy one; `bias` (row, token, bias) and `banned` (row, token)
    as the sampler's logit_bias and banned tokens; `states`: each generator's state before the
    step, in the order the sampled rows first name it; `stream`: per sampled row (rule not None), in
    order, the index of its generator in `states`; `forced`: the rows whose token is forced after
    the pick (a thinking cap), put in on every rank, so that every rank holds the step's tokens as
    rank 0 does (the next step's pending ids name them: async scheduling)."""

    rows: tuple[int, ...] | None
    rules: tuple[Rule | None, ...]
    bias: tuple[tuple[int, int, float], ...]
    banned: tuple[tuple[int, int], ...]
    states: tuple[bytes, ...]
    stream: tuple[int, ...]
    forced: Forced | None = None

    @classmethod
    def of(
        cls,
        rows: Sequence[int] | None,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        banned: Sequence[Sequence[int]] | None = None,
        forced: Forced | None = None,
    ) -> ShardedSampling:
        """The step's sampling from rank 0's requests (read the generators' states before drawing)."""
        rules, states, stream, index = [], [], [], {}
        for p, generator in zip(params, generators, strict=True):
            if not shardable(p):
                raise ValueError(f"{p} cannot be sampled from vocabulary shards (top_p, penalties or logprobs)")
            if p.greedy:
                rules.append(None)
                continue
            rules.append(Rule(p.temperature, p.top_k, p.min_p))
            if id(generator) not in index:
                index[id(generator)] = len(states)
                states.append(bytes(generator.get_state().numpy()))
            stream.append(index[id(generator)])
        bias = tuple((row, token, value) for row, p in enumerate(params) for token, value in p.logit_bias)
        bans = tuple((row, token) for row, tokens in enumerate(banned or ()) for token in tokens)
        return cls(
            tuple(rows) if rows is not None else None, tuple(rules), bias, bans, tuple(states), tuple(stream), forced
        )

    def generators(self, device: torch.device) -> list[torch.Generator | None]:
        """A worker's generators, one per row, at rank 0's states (rows of one generator share it)."""
        made = []
        for state in self.states:
            generator = torch.Generator(device=device)
            generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
            made.append(generator)
        streams = iter(self.stream)
        return [None if rule is None else made[next(streams)] for rule in self.rules]


def shardable(params: SamplingParams) -> bool:
    """Whether a request's rows can be sampled from vocabulary shards (see the module docstring)."""
    return (params.greedy or params.top_p >= 1.0) and not params.penalized and params.logprobs is None


def gather_logits(local: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Every rank's [n, V / world] put together: [n, V], the vocabulary in order."""
    return all_gather_columns(local, shard.group)


def _adjusted(logits: torch.Tensor, sampling: ShardedSampling, start: int) -> torch.Tensor:
    """logits with the biases and bans of this shard's columns applied (an fp32 copy), or as they are."""
    stop = start + logits.shape[1]
    bias = [(r, t - start, b) for r, t, b in sampling.bias if start <= t < stop]
    bans = [(r, t - start) for r, t in sampling.banned if start <= t < stop]
    if not (sampling.bias or sampling.banned):  # the same on every rank: any bias anywhere makes an fp32 copy
        return logits
    out, device = logits.to(torch.float32, copy=True), logits.device
    if bias:
        at = device_tensor([[r for r, _, _ in bias], [t for _, t, _ in bias]], torch.int64, device)
        out.index_put_((at[0], at[1]), device_tensor([b for _, _, b in bias], torch.float32, device), accumulate=True)
    if bans:
        at = device_tensor([[r for r, _ in bans], [t for _, t in bans]], torch.int64, device)
        out.index_put_((at[0], at[1]), torch.full((), float("-inf"), device=device))
    return out


def _comparable(values: torch.Tensor) -> torch.Tensor:
    """values in fp32 with NaN as +inf: a faulty row's maximum wins every comparison and stays non-finite."""
    return torch.nan_to_num(values.float(), nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))


def _merged_top(shard: VocabShard) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """top_k's values over the whole row: each rank's k largest, gathered, the k largest of those."""

    def top_values(scaled: torch.Tensor, k: int) -> torch.Tensor:
        local = torch.topk(scaled, min(k, scaled.shape[1]), dim=-1).values
        if local.shape[1] < k:  # a shard narrower than k: pad, every rank alike
            local = torch.nn.functional.pad(local, (0, k - local.shape[1]), value=float("-inf"))
        everyone = shard.exchange(local.contiguous())  # [world, n, k]
        return torch.topk(everyone.permute(1, 0, 2).reshape(local.shape[0], -1), k, dim=-1).values

    return top_values


def pack_candidates(value: torch.Tensor, index: torch.Tensor, rank: int, world: int, start: int) -> torch.Tensor:
    """kernels/shard_pick.py's (imported here: the reference path never imports triton)."""
    from qruntime.kernels import shard_pick

    return shard_pick.pack_candidates(value, index, rank, world, start)


def pick_best(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/shard_pick.py's."""
    from qruntime.kernels import shard_pick

    return shard_pick.pick_best(stacked)


def sample_shard(
    local: torch.Tensor,
    sampling: ShardedSampling,
    shard: VocabShard,
    generators: Sequence[torch.Generator | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run on every rank with its logits [n, V / world]: (token ids [m], each row's maximum logit [m])
    of the step's sampled rows, on the device, the same on every rank. `generators`: rank 0's own
    (advanced by the draws, as tp=1's are), None on the workers (made from the step's states)."""
    cols = local.shape[1]
    vocab, start, device = cols * shard.world, shard.rank * cols, local.device
    if vocab >= MAX_SHARDED_VOCAB:
        raise ValueError(f"a vocabulary of {vocab} tokens is too large for sharded sampling (ids travel as fp32)")
    logits = local if sampling.rows is None else local[device_tensor(list(sampling.rows), torch.int64, device)]
    if logits.shape[0] != len(sampling.rules):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(sampling.rules)} rules")
    logits = _adjusted(logits, sampling, start)
    value, index = logits.max(-1)
    sampled = [row for row, rule in enumerate(sampling.rules) if rule is not None]
    peaks = None
    if sampled:
        value = _comparable(value)
        peaks = shard.exchange(value[:, None].contiguous()).amax(0)[:, 0]  # each row's maximum
        at = device_tensor(sampled, torch.int64, device) if len(sampled) < len(sampling.rules) else None
        rules = [sampling.rules[row] for row in sampled]
        weights = log_weights(
            logits if at is None else logits[at],
            peaks if at is None else peaks[at],
            rules,
            vocab,
            _merged_top(shard),
        )
        if generators is None:
            generators = sampling.generators(device)
        draws = exponentials((len(sampled), vocab), [generators[row] for row in sampled], device)
        won, where = race(weights, draws[:, start : start + cols]).max(-1)
        if at is None:
            value, index = won, where
        else:
            value, index = value.index_copy(0, at, won), index.index_copy(0, at, where)
    if kernel_runs_on(device):  # one launch to pack, the exchange, one to pick
        ids, best = pick_best(shard.exchange_stacked(pack_candidates(value, index, shard.rank, shard.world, start)))
    else:
        pairs = torch.stack([_comparable(value), (index + start).float()], dim=1)  # the rank's best and its id
        everyone = shard.exchange(pairs)  # [world, n, 2]
        winner = everyone[:, :, 0].argmax(0)  # the first rank of the best: the lowest id among equals
        ids = everyone[winner, torch.arange(pairs.shape[0], device=device), 1].long()
        best = everyone[:, :, 0].amax(0)
    return ids, peaks if peaks is not None else best


def finish_step(
    shard: VocabShard | None,
    logits: torch.Tensor,
    sampling: ShardedSampling | None,
    generators: Sequence[torch.Generator | None] | None = None,
    in_flight: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What a rank does with its step's logits: without a shard, nothing (they are whole); with one,
    sample them together (`sampling`: the token ids, forced rows put in, and row maxima) or put the
    rows together (None). `in_flight`: the step before's token ids, which forced rows' conditions read."""
    if shard is None:
        if sampling is not None:
            raise ValueError("sharded sampling asked of a rank whose logits are whole")
        return logits
    if sampling is None:
        return gather_logits(logits, shard)
    ids, peaks = sample_shard(logits, sampling, shard, generators)
    if sampling.forced is not None:
        ids = apply_forced(ids, sampling.forced, in_flight)
    return ids, peaks


def share_tokens(shard: VocabShard, ids: torch.Tensor | None, count: int, device: torch.device) -> torch.Tensor:
    """Rank 0's `count` token ids (int64 on the device), on every rank: rank 0 passes them, the others
    None. For a step whose rows rank 0 sampled alone (gathered rows: top_p, penalties, ...), so that
    every rank holds its tokens for the next step's pending ids (async scheduling). Through the
    exchange, as fp32: exact, ids being below MAX_SHARDED_VOCAB."""
    mine = torch.zeros(count, dtype=torch.float32, device=device) if ids is None else ids.to(torch.float32)
    return shard.exchange(mine)[0].to(torch.int64)


def warm_up(shard: VocabShard, columns: int, dtype: torch.dtype, device: torch.device) -> None:
    """Sample a greedy and a seeded row from zero logits of this rank's shard, on every rank together
    (a collective: build_rank calls it on each), so that the first step builds no kernel."""
    logits = torch.zeros(1, columns, dtype=dtype, device=device)
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=0)):
        generator = torch.Generator(device=device).manual_seed(0)
        sampling = ShardedSampling.of(None, [params], [generator])
        sample_shard(logits, sampling, shard, sampling.generators(device))
