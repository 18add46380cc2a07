"""Draft methods, by name. A proposer (draft.Proposer) sees a request's tokens (prompt then outputs)
and proposes up to k next tokens: deterministically (a tuple of ids: a point mass, which
rejection.verify_drafts accepts with the target's probability of each token), or drawn from
distributions it returns with them (a draft.Draft, whose distributions the verification needs).

prompt-lookup (prompt_lookup.py): n-gram matches in the prompt and output so far; no model.
draft-model (draft_model.py): a smaller artifact with the same vocabulary, its own KV cache.
layer-skip (self_draft.py): the target's own plan less the decoder layers the artifact names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from qruntime.engine.speculative.draft import Proposer, ProposerContext, ProposerOptions
from qruntime.engine.speculative.draft_model import DraftModel
from qruntime.engine.speculative.prompt_lookup import PromptLookup
from qruntime.engine.speculative.self_draft import LayerSkipDraft

__all__ = ["PROPOSERS", "DraftModel", "LayerSkipDraft", "PromptLookup"]


def _prompt_lookup(config: ProposerOptions, context: ProposerContext | None = None) -> Proposer:
    return PromptLookup(config.prompt_lookup_min, config.prompt_lookup_max)


def _draft_model(config: ProposerOptions, context: ProposerContext | None = None) -> Proposer:
    if context is None or config.draft_model is None:
        raise ValueError("the draft-model method needs a draft artifact (draft_model=PATH) and an engine loading it")
    return DraftModel(context.load_artifact(config.draft_model), config.chain)


def _layer_skip(config: ProposerOptions, context: ProposerContext | None = None) -> Proposer:
    skip = config.skip_layers if config.skip_layers is not None else (context.draft_layers if context else None)
    return LayerSkipDraft(skip or (), config.chain)


# method name -> builder from the config (read-only: no module-level mutable state)
PROPOSERS: Mapping[str, Callable[[ProposerOptions, ProposerContext | None], Proposer]] = MappingProxyType(
    {"prompt-lookup": _prompt_lookup, "draft-model": _draft_model, "layer-skip": _layer_skip}
)
