"""What proposers and the engine exchange: the request drafted for, the draft, and the protocol a
draft method implements (proposers.py names them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from qruntime.engine.sampler import log_weights, sample_on_device
from qruntime.engine.sampling_params import SamplingParams
from qruntime.engine.step_chunk import StepChunk


class ProposerOptions(Protocol):
    """What a proposer is built from (a config.SpeculativeConfig)."""

    prompt_lookup_min: int
    prompt_lookup_max: int
    draft_model: str | None
    skip_layers: tuple[int, ...] | None


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


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer may need from the engine being loaded: load_artifact(path) gives an engine of
    another artifact on the target's device, in its dtype (a draft model)."""

    load_artifact: Callable[[str], Any]
    draft_layers: tuple[int, ...] | None = None  # the artifact's layers to skip (manifest speculative.draft_layers)


def decode_draft(forward: Callable[[StepChunk], torch.Tensor], chunk: StepChunk, k: int, request: DraftFor) -> Draft:
    """Up to k draft tokens decoded by a model: forward(chunk) gives the logits [1, V] after the
    chunk's last token, and each token drawn is the next chunk, at the position after it (same
    block table). Greedy requests take the argmax; sampled ones draw under their sampling params
    with their generator, and the distributions drawn from come back with the tokens. Stops early
    at non-finite logits."""
    greedy = request.generator is None or request.params.greedy
    tokens: list[int] = []
    probs: list[torch.Tensor] = []
    for _ in range(k):
        logits = forward(chunk)
        token = sample_on_device(logits, [request.params], [None if greedy else request.generator]).tolist()[0]
        if token is None:
            break
        tokens.append(token)
        if not greedy:
            best = logits.float().max(-1).values
            probs.append(log_weights(logits.float(), best, [request.params]).softmax(-1))
        chunk = StepChunk((token,), chunk.start + chunk.num_tokens, chunk.block_table)
    return Draft(tuple(tokens), torch.cat(probs) if probs else None)
