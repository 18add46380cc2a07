"""What proposers and the engine exchange: the request drafted for, the draft, and the protocol a
draft method implements (proposers.py names them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from qruntime.engine.sampled_tokens import SampledTokens
from qruntime.engine.sampler import log_weights, sample_on_device
from qruntime.engine.sampling_params import SamplingParams
from qruntime.engine.step_chunk import StepChunk, pending


class ProposerOptions(Protocol):
    """What a proposer is built from (a config.SpeculativeConfig)."""

    prompt_lookup_min: int
    prompt_lookup_max: int
    draft_model: str | None
    skip_layers: tuple[int, ...] | None
    chain: bool


@dataclass(frozen=True)
class DraftFor:
    """The request a proposer drafts for: its id (a model's state is per request), its sampling
    parameters and its random generator (None: greedy)."""

    request_id: str
    params: SamplingParams
    generator: torch.Generator | None
    # grow(n): the request's KV block table grown to hold n tokens (None: no room), for a draft that
    # writes the target's cache past the request's computed tokens (layer-skip)
    grow: Callable[[int], tuple[int, ...] | None] | None = None


@dataclass(frozen=True)
class Draft:
    """Draft tokens [k] and the distributions they were drawn from, probs [k, V] on the device
    (None: greedy, or a point mass)."""

    tokens: tuple[int, ...]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], k: int, request: DraftFor | None = None) -> tuple[int, ...] | Draft:
        """At most k draft tokens to follow token_ids (none: no guess worth verifying)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished: drop what the proposer keeps for it."""
        ...

    def close(self) -> None:
        """The engine closes: release what the proposer holds."""
        ...

    def attach(self, runner: Any) -> None:
        """The target's model runner, once it is built (a draft that runs the target's own plan)."""
        ...

    def has_idle_work(self) -> bool:
        """Whether start-up work was left for later (graphs captured at first use: a draft's)."""
        ...

    def idle_work(self) -> bool:
        """Do one piece of that work, for an engine with nothing to run; returns whether any is left."""
        ...


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer may need from the engine being loaded: load_artifact(path) gives an engine of
    another artifact on the target's device, in its dtype (a draft model)."""

    load_artifact: Callable[[str], Any]
    draft_layers: tuple[int, ...] | None = None  # the artifact's layers to skip (manifest speculative.draft_layers)


# chain(chunks, remaining, sampled): token ids and peaks [max(remaining), len(chunks)] of greedy decode
# steps from one-token chunks, row b's first remaining[b] its own (engine/decode_chains.py), or None
# where it cannot run them
Chain = Callable[[Sequence[StepChunk], Sequence[int], torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]


def decode_drafts(
    forward: Callable[[Sequence[StepChunk], Sequence[int], torch.Tensor | None], torch.Tensor],
    chunks: Sequence[StepChunk],
    ks: Sequence[int],
    requests: Sequence[DraftFor],
    chain: Chain | None = None,
) -> list[Draft]:
    """Up to ks[i] draft tokens for each request, decoded by a model in batched steps: forward(chunks,
    rows, sampled) gives the logits [len(chunks), V] after each chunk's last token (rows: the
    requests' indices in the batch, one a chunk). Each request's token drawn is its next chunk, at
    the position after it (same block table), until it has its k: a pending id (step_chunk.pending)
    naming its row of `sampled`, the ids the step before drew, still on the device. Greedy requests
    take the argmax; sampled ones draw under their sampling params with their generator, and the
    distributions drawn from come back with the tokens. The host reads the drawn tokens once, after
    the last step (each step's copy queued behind it), not once a step: the steps queue back to back.
    A request's draft ends before its first token drawn from non-finite logits (the steps after it
    run on the device all the same, their tokens dropped). With a `chain`, the steps after the
    first, when every request still drafting is greedy without a logit bias, are one chain of greedy
    steps instead (one replay on the device), if it can run them."""
    greedy = [r.generator is None or r.params.greedy for r in requests]
    argmax = [g and not r.params.logit_bias for g, r in zip(greedy, requests, strict=True)]  # what a chain draws
    steps: list[
        tuple[list[int], SampledTokens, list[int], torch.Tensor | None]
    ] = []  # live, drawn, sampled rows, weights
    current = list(chunks)
    live = [i for i, k in enumerate(ks) if k > 0]
    previous = None
    while live:
        if chain is not None and previous is not None and all(argmax[i] for i in live):
            remaining = [ks[i] - len(steps) for i in live]
            made = chain([current[i] for i in live], remaining, previous.ids)
            if made is not None:
                steps.extend(_chained(live, remaining, *made))
                break
        logits = forward([current[i] for i in live], live, None if previous is None else previous.ids)
        params = [requests[i].params for i in live]
        drawn = sample_on_device(logits, params, [None if greedy[i] else requests[i].generator for i in live])
        sampled = [row for row, i in enumerate(live) if not greedy[i]]
        weights = None
        if sampled:
            rows = logits[sampled].float()
            weights = log_weights(rows, rows.max(-1).values, [params[row] for row in sampled]).softmax(-1)
        steps.append((live, drawn, sampled, weights))
        following = []
        for row, i in enumerate(live):
            if len(steps) < ks[i]:  # every live request drew one token a step
                chunk = current[i]
                current[i] = StepChunk((pending(row),), chunk.start + chunk.num_tokens, chunk.block_table)
                following.append(i)
        live, previous = following, drawn
    tokens: list[list[int]] = [[] for _ in chunks]
    probs: list[list[torch.Tensor]] = [[] for _ in chunks]
    ended: set[int] = set()
    for live, drawn, sampled, weights in steps:
        for row, (i, token) in enumerate(zip(live, drawn.tolist(), strict=True)):
            if i in ended or token is None:
                ended.add(i)
                continue
            tokens[i].append(token)
            if not greedy[i]:
                probs[i].append(weights[sampled.index(row)])
    return [Draft(tuple(t), torch.stack(p) if p else None) for t, p in zip(tokens, probs, strict=True)]


class _ChainStep:
    """One step of a chain's output as decode_drafts reads a step's drawn tokens: `tolist()` gives the
    tokens of the rows `rows` of the chain's step `step` (None where not finite), all read in one copy."""

    def __init__(self, tokens: SampledTokens, width: int, step: int, rows: Sequence[int]) -> None:
        self.tokens, self.offset, self.rows = tokens, width * step, rows

    def tolist(self) -> list[int | None]:
        read = self.tokens.tolist()
        return [read[self.offset + row] for row in self.rows]


def _chained(
    live: Sequence[int], remaining: Sequence[int], ids: torch.Tensor, peaks: torch.Tensor
) -> list[tuple[list[int], _ChainStep, list[int], None]]:
    """decode_drafts' steps from a chain's ids and peaks [steps, len(live)]: step s holds the requests
    with more than s tokens to go."""
    tokens = SampledTokens(ids.reshape(-1), peaks.reshape(-1))
    width, made = len(live), []
    for step in range(ids.shape[0]):
        rows = [row for row, left in enumerate(remaining) if left > step]
        made.append(([live[row] for row in rows], _ChainStep(tokens, width, step, rows), [], None))
    return made
