"""One engine step on the model: the step's chunks become the graph's inputs and attention metadata
(built once per step, shared by every layer), the plan runs, logits come back.

Decode-only steps replay a captured graph per batch size (cuda_graphs.DecodeGraphs); other steps
that fit a token bucket replay piecewise graphs, attention run eagerly between the pieces
(piecewise_graphs.PiecewiseGraphs); the rest, and steps that want every token's logits, run the
plan op by op.

A step is plain data (step_chunk.StepChunk: token ids, start position, block table), so rank 0 of a
tensor-parallel engine can send it to the other ranks, which run this same code on their shard."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qruntime.engine.cuda_graphs import DecodeGraphs
from qruntime.engine.piecewise_graphs import PiecewiseGraphs
from qruntime.engine.sampled_tokens import resolve_pending
from qruntime.engine.step_chunk import StepChunk
from qruntime.kv_cache import KVCache
from qruntime.ops.base import AttentionMetadata, StepContext
from qruntime.plan import Plan


class ModelRunner:
    def __init__(
        self,
        plan: Plan,
        kv_cache: KVCache,
        device: torch.device,
        max_context_len: int,
        decode_graphs: DecodeGraphs | None = None,
        piecewise_graphs: PiecewiseGraphs | None = None,
    ) -> None:
        self.plan = plan
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.spec.block_size
        self.max_context_len = max_context_len
        self.decode_graphs = decode_graphs
        self.piecewise_graphs = piecewise_graphs

    def drop_graphs(self) -> None:
        """Forget the captured graphs, decode and piecewise, once the device has finished with them
        (their memory pools go back to the allocator); steps after this run eagerly."""
        if self.decode_graphs is not None or self.piecewise_graphs is not None:
            torch.cuda.synchronize(self.device)
            self.decode_graphs = self.piecewise_graphs = None

    def prepare(
        self, chunks: Sequence[StepChunk], all_logits: bool = False
    ) -> tuple[dict[str, torch.Tensor], AttentionMetadata]:
        """Graph inputs (docs/OPS.md) and attention metadata for one step. logits_indices picks each
        chunk's last token, or with all_logits every token of the step."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        starts = [0]
        context_lens: list[int] = []
        width = max(len(c.block_table) for c in chunks)
        tables = torch.zeros(len(chunks), width, dtype=torch.int32)
        for b, chunk in enumerate(chunks):
            end = chunk.start + chunk.num_tokens
            ids += chunk.token_ids
            positions += range(chunk.start, end)
            starts.append(starts[-1] + chunk.num_tokens)
            context_lens.append(end)
            tables[b, : len(chunk.block_table)] = torch.tensor(chunk.block_table, dtype=torch.int32)
        # slot of every position of every sequence: block_table[pos // bs] * bs + pos % bs
        all_slots = (tables.long()[:, :, None] * bs + torch.arange(bs)).reshape(len(chunks), -1)
        pos = torch.tensor(positions, dtype=torch.int64)
        seq_of_token = torch.repeat_interleave(
            torch.arange(len(chunks)), torch.tensor(starts[1:]) - torch.tensor(starts[:-1])
        )
        slot_mapping = all_slots[seq_of_token, pos]
        feeds = {
            "input_ids": torch.tensor(ids, dtype=torch.int64),
            "positions": pos,
            "slot_mapping": slot_mapping,
            "block_tables": tables,
            "context_lens": torch.tensor(context_lens, dtype=torch.int32),
            "query_start_loc": torch.tensor(starts, dtype=torch.int32),
            "logits_indices": torch.arange(starts[-1]) if all_logits else torch.tensor(starts[1:]) - 1,
        }
        feeds = {name: t.to(self.device) for name, t in feeds.items()}
        device_slots = all_slots.to(self.device)
        meta = AttentionMetadata(
            query_start=tuple(starts),
            context_lens=tuple(context_lens),
            cache_slots=tuple(device_slots[b, :n] for b, n in enumerate(context_lens)),
            max_q_len=max(c.num_tokens for c in chunks),
            max_context_len=self.max_context_len,
        )
        return feeds, meta

    @torch.inference_mode()
    def execute(
        self, chunks: Sequence[StepChunk], all_logits: bool = False, sampled: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run the plan on the step's chunks; logits [len(chunks), V] of each chunk's last token
        (all_logits: [tokens, V], a row per token of the step). With captured graphs, decode steps
        replay a decode graph, and other steps that fit a token bucket the piecewise graphs.
        `sampled`: the previous step's sampled ids on the device, which the chunks' pending ids
        (step_chunk.pending) name by row."""
        if self.decode_graphs is not None and not all_logits and self.decode_graphs.fits(chunks, sampled):
            return self.decode_graphs.run(chunks, sampled)
        feeds, meta = self.prepare(chunks, all_logits)
        if sampled is not None:
            feeds["input_ids"] = resolve_pending(feeds["input_ids"], sampled)
        piecewise = self.piecewise_graphs
        if piecewise is not None and not all_logits and piecewise.fits(len(feeds["input_ids"])):
            return piecewise.run(feeds, meta)
        return self.plan.run(StepContext(self.kv_cache, meta), feeds)
