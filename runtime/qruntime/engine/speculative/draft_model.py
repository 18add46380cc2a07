"""draft-model: a smaller artifact with the target's vocabulary (qwen3-0.6b for qwen3-8b, say)
drafts k tokens autoregressively, with its own KV cache.

The draft is a loaded Engine of its own, of which this uses the model runner and the block pool (its
scheduler never runs). For each request it remembers the tokens whose KV its cache holds; a new
proposal first computes what is missing (the prompt on the first call; then the tokens the last
verification kept that the draft did not compute itself), then decodes k - 1 more (with
SpeculativeConfig.chain, for greedy requests on a GPU, as one replay of a chain of decode steps:
decode_chains.py). Greedy requests draft greedily; sampled ones draw each draft token from the
draft's distribution under the request's temperature / top-k / top-p / min-p, with its generator,
and return those distributions for the verification. A request the draft's pool has no room for gets
no draft (it decodes as usual).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from qruntime.engine.block_manager import NoFreeBlocks
from qruntime.engine.decode_chains import DecodeChains
from qruntime.engine.speculative.draft import Draft, DraftFor, decode_drafts
from qruntime.engine.step_chunk import StepChunk


class DraftModel:
    batches = True  # propose_batch: every decoding request's drafts in shared steps of the draft model

    def __init__(self, engine: Any, chain: bool = False) -> None:
        self.engine = engine  # the draft artifact's Engine: runner, scheduler.block_manager, max_model_len
        self._computed: dict[str, list[int]] = {}  # request id -> the tokens whose KV the draft's cache holds
        # greedy draft steps after the first as one replay (decode_chains.py), where the draft's runner
        # replays decode graphs
        runner = engine.runner
        graphs = runner.decode_graphs if chain and runner.vocab_shard is None and not runner.mrope else None
        self.chains = DecodeChains(graphs) if graphs is not None else None

    def propose(self, token_ids: Sequence[int], k: int, request: DraftFor | None = None) -> Draft:
        if request is None:
            raise ValueError("the draft model drafts for a request (its id keys the draft's KV cache)")
        return self.propose_batch([(token_ids, k, request)])[0]

    def propose_batch(self, items: Sequence[tuple[Sequence[int], int, DraftFor]]) -> list[Draft]:
        """Drafts for several requests (token ids, k, request each), decoded together: the first step
        computes what each request's KV lacks in the draft's cache (its prompt on the first call, then
        the tokens the last verification kept that the draft did not compute), beside the others', then
        one batched decode step per draft token. A request the draft's pool has no room for gets none."""
        manager = self.engine.scheduler.block_manager
        drafts = [Draft(())] * len(items)
        chunks, ks, requests, placed, computed = [], [], [], [], []
        for index, (token_ids, k, request) in enumerate(items):
            rid, length = request.request_id, len(token_ids)
            k = min(k, self.engine.max_model_len - length + 1)  # the draft's KV ends at position length + k - 2
            if k < 1:
                continue
            start = _common_prefix(self._computed.get(rid, []), token_ids, length - 1)
            try:
                table = manager.grow(rid, length + k - 1)
            except NoFreeBlocks:
                continue
            computed.append(list(token_ids))  # the draft's KV holds these once its first step ran
            self._computed[rid] = list(token_ids[:start])  # until then (a step that fails leaves this)
            chunks.append(StepChunk(tuple(token_ids[start:]), start, table))
            ks.append(k)
            requests.append(request)
            placed.append(index)
        if not chunks:
            return drafts

        def forward(step: Sequence[StepChunk], _rows: Sequence[int], sampled: torch.Tensor | None) -> torch.Tensor:
            # [len(step), V]: after each chunk's last token
            return self.engine.runner.execute(list(step), sampled=sampled)

        made = decode_drafts(forward, chunks, ks, requests, self._chain)
        for row, (index, draft, k) in enumerate(zip(placed, made, ks, strict=True)):
            drafts[index] = draft
            # fed after the first step: each drafted token but the last (k - 1 at most; past a draft
            # that ended early, the steps fed tokens that are not kept, whose KV is not counted)
            self._computed[requests[row].request_id] = computed[row] + list(draft.tokens[: k - 1])
        return drafts

    def _chain(
        self, chunks: Sequence[StepChunk], remaining: Sequence[int], sampled: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """decode_drafts' chain: greedy steps as one replay of the draft's decode graphs, where they fit."""
        if self.chains is None or self.engine.runner.decode_graphs is None:
            return None  # no chains, or the runner dropped its graphs (their pool is gone)
        return self.chains.run_fitting(chunks, remaining, sampled)

    def forget(self, request_id: str) -> None:
        """Free the request's blocks in the draft's pool."""
        self._computed.pop(request_id, None)
        self.engine.scheduler.block_manager.free(request_id)

    def close(self) -> None:
        self.engine.close()

    def attach(self, runner: Any) -> None:
        """The draft has its own runner."""

    def has_idle_work(self) -> bool:
        return self.engine.runner.has_idle_work()

    def idle_work(self) -> bool:
        """The draft engine's start-up work (its graphs, largest first, then its warm-up steps): its
        scheduler never has a request, so the engine does it whenever it is asked."""
        return self.engine.idle_work()


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most limit."""
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
