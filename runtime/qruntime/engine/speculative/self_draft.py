"""layer-skip: self-speculative decoding. The target drafts with its own plan less some decoder
layers (layer_skip.py), chosen offline by `qcompile compile --draft-layers` and stored in the
artifact's manifest (speculative.draft_layers), so no extra weights and no search at load.

The draft shares the target's KV cache: the layers it keeps read the KV the target computed for
the request's tokens, and write their own for the token being decoded and the drafts after it, in
blocks the scheduler grows for them (DraftFor.grow); the verification then computes those positions
again in every layer, so nothing the draft wrote outlives it. Each draft token is one step of the
reduced plan, greedy or drawn (with its distribution kept for the verification) as for draft-model
(with SpeculativeConfig.chain, greedy steps after the first are one replay of a chain of decode
steps: decode_chains.py), and the requests of a step draft together (the engine's draft_ahead): one
reduced step a draft token for the whole batch, its blocks grown only where that leaves every running
request's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from qruntime.engine.cuda_graphs import DecodeGraphs
from qruntime.engine.decode_chains import DecodeChains
from qruntime.engine.sampled_tokens import resolve_pending
from qruntime.engine.speculative.draft import Draft, DraftFor, decode_drafts
from qruntime.engine.speculative.layer_skip import skip_layers
from qruntime.engine.step_chunk import StepChunk
from qruntime.ops.base import StepContext


class LayerSkipDraft:
    batches = True  # propose_batch: every decoding request's drafts in shared steps of the reduced plan

    def __init__(self, skip: Sequence[int], chain: bool = False) -> None:
        if not skip:
            raise ValueError(
                "layer-skip needs layers to skip: this artifact names none (qcompile compile --draft-layers)"
            )
        self.skip = tuple(sorted(set(skip)))
        self.runner: Any = None
        self.plan: Any = None
        self.graphs: DecodeGraphs | None = None
        self.chain = chain  # greedy draft steps after the first as one replay (decode_chains.py)
        self.chains: DecodeChains | None = None

    def attach(self, runner: Any) -> None:
        """Build the reduced plan from the target's (ValueError when a listed layer cannot be skipped),
        and, where the target captures its decode steps, decode graphs of it at the target's batch
        buckets, each captured at its first use: a draft step is then one replay for the whole batch
        instead of the reduced plan's ops launched one by one (on the GPU that was ~26 ms a
        verification of a 16-layer 104M model, ~95 tokens/s at any batch: bench/spec_bench.py), or
        one replay a request (at batch 8 the draft's single-row replays, 1,139 in 47 steps, took
        10.2 ms of a step's 14.2 on the H200: spec_step_profile at 568c92f)."""
        self.runner = runner
        self.plan = skip_layers(runner.plan, self.skip)
        target = runner.decode_graphs
        if target is not None:
            self.graphs = DecodeGraphs(
                self.plan,
                runner.kv_cache,
                target.scratch_block,
                runner.max_context_len,
                target.buckets,
                capture=target.capturer,  # the target's pool: draft and target steps take turns
                lazy=True,
            )
            if self.chain and runner.vocab_shard is None and not runner.mrope:
                self.chains = DecodeChains(self.graphs)

    def propose(self, token_ids: Sequence[int], k: int, request: DraftFor | None = None) -> Draft:
        if request is None:
            raise ValueError("the layer-skip draft runs inside an engine step (it writes the request's KV blocks)")
        return self.propose_batch([(token_ids, k, request)])[0]

    def propose_batch(self, items: Sequence[tuple[Sequence[int], int, DraftFor]]) -> list[Draft]:
        """Drafts for several requests (token ids, k, request each), decoded together: each step runs
        the reduced plan once over every request still drafting. A request whose blocks cannot grow
        for its drafts (request.grow gives None) gets none."""
        if self.plan is None or any(request.grow is None for _, _, request in items):
            raise ValueError("the layer-skip draft runs inside an engine step (it writes the request's KV blocks)")
        drafts = [Draft(())] * len(items)
        chunks, ks, requests, placed = [], [], [], []
        for index, (token_ids, k, request) in enumerate(items):
            length = len(token_ids)
            table = request.grow(length + k - 1)  # the draft writes positions length - 1 .. length + k - 2
            if table is None:
                continue
            chunks.append(StepChunk((token_ids[-1],), length - 1, table))
            ks.append(k)
            requests.append(request)
            placed.append(index)
        if chunks:
            chain = self.chains.run_fitting if self.chains is not None else None
            made = decode_drafts(self._forward, chunks, ks, requests, chain)
            for index, draft in zip(placed, made, strict=True):
                drafts[index] = draft
        return drafts

    def _forward(self, chunks: Sequence[StepChunk], _rows: Sequence[int], sampled: torch.Tensor | None) -> torch.Tensor:
        """Logits [len(chunks), V] of the reduced plan after each chunk's token: the graph's output, read
        before its next replay."""
        if self.graphs is not None and self.graphs.fits(chunks, sampled):
            return self.graphs.run(chunks, sampled)
        feeds, meta = self.runner.prepare(list(chunks))
        if sampled is not None:
            feeds["input_ids"] = resolve_pending(feeds["input_ids"], sampled)
        return self.plan.run(StepContext(self.runner.kv_cache, meta), feeds)

    def has_idle_work(self) -> bool:
        return self.graphs is not None and bool(self.graphs.pending)

    def idle_work(self) -> bool:
        """Capture the largest decode bucket of the reduced plan not captured yet."""
        if self.has_idle_work():
            self.graphs.capture(self.graphs.pending[-1])
        return self.has_idle_work()

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request (the KV it wrote is the request's, rewritten by verification)."""

    def close(self) -> None:
        """The plan's ops and weights are the target's; its decode graphs and chains go."""
        self.graphs = self.chains = None
