"""layer-skip: self-speculative decoding. The target drafts with its own plan less some decoder
layers (layer_skip.py), chosen offline by `qcompile compile --draft-layers` and stored in the
artifact's manifest (speculative.draft_layers), so no extra weights and no search at load.

The draft shares the target's KV cache: the layers it keeps read the KV the target computed for
the request's tokens, and write their own for the token being decoded and the drafts after it, in
blocks the scheduler grows for them (DraftFor.grow); the verification then computes those positions
again in every layer, so nothing the draft wrote outlives it. Each draft token is one step of the
reduced plan, greedy or drawn (with its distribution kept for the verification) as for draft-model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from qruntime.engine.cuda_graphs import DecodeGraphs
from qruntime.engine.sampled_tokens import resolve_pending
from qruntime.engine.speculative.draft import Draft, DraftFor, decode_draft
from qruntime.engine.speculative.layer_skip import skip_layers
from qruntime.engine.step_chunk import StepChunk
from qruntime.ops.base import StepContext


class LayerSkipDraft:
    def __init__(self, skip: Sequence[int]) -> None:
        if not skip:
            raise ValueError(
                "layer-skip needs layers to skip: this artifact names none (qcompile compile --draft-layers)"
            )
        self.skip = tuple(sorted(set(skip)))
        self.runner: Any = None
        self.plan: Any = None
        self.graphs: DecodeGraphs | None = None

    def attach(self, runner: Any) -> None:
        """Build the reduced plan from the target's (ValueError when a listed layer cannot be skipped),
        and, where the target captures its decode steps, a decode graph of it: a draft token is then
        one replay instead of the reduced plan's ops launched one by one (on the GPU that was ~26 ms a
        verification of a 16-layer 104M model, ~95 tokens/s at any batch: bench/spec_bench.py)."""
        self.runner = runner
        self.plan = skip_layers(runner.plan, self.skip)
        target = runner.decode_graphs
        if target is not None:
            self.graphs = DecodeGraphs(self.plan, runner.kv_cache, target.scratch_block, runner.max_context_len, (1,))

    def propose(self, token_ids: Sequence[int], k: int, request: DraftFor | None = None) -> Draft:
        if request is None or request.grow is None or self.plan is None:
            raise ValueError("the layer-skip draft runs inside an engine step (it writes the request's KV blocks)")
        length = len(token_ids)
        table = request.grow(length + k - 1)  # the draft writes positions length - 1 .. length + k - 2
        if table is None:
            return Draft(())

        def forward(chunk: StepChunk, sampled: torch.Tensor | None) -> torch.Tensor:
            if self.graphs is not None and self.graphs.fits([chunk], sampled):
                return self.graphs.run([chunk], sampled)  # [1, V], the graph's output: read before the next replay
            feeds, meta = self.runner.prepare([chunk])
            if sampled is not None:
                feeds["input_ids"] = resolve_pending(feeds["input_ids"], sampled)
            return self.plan.run(StepContext(self.runner.kv_cache, meta), feeds)  # [1, V]

        return decode_draft(forward, StepChunk((token_ids[-1],), length - 1, table), k, request)

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request (the KV it wrote is the request's, rewritten by verification)."""

    def close(self) -> None:
        """The plan's ops and weights are the target's; its decode graph goes."""
        self.graphs = None
