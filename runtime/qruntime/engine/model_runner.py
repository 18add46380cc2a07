"""One engine step on the model: the step's chunks become the graph's inputs and attention metadata
(built once per step, shared by every layer), the plan runs, logits come back.

Decode-only steps replay a captured graph per batch size (cuda_graphs.DecodeGraphs); other steps
that fit a token bucket replay a whole-step graph (mixed_graphs.MixedGraphs), or, where attention
prefers an eager launch, piecewise graphs with attention run eagerly between the pieces
(piecewise_graphs.PiecewiseGraphs); the rest, and steps that want every token's logits, run the
plan op by op.

A step is plain data (step_chunk.StepChunk: token ids, start position, block table), so rank 0 of a
tensor-parallel engine can send it to the other ranks, which run this same code on their shard."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from qruntime.engine.cuda_graphs import DecodeGraphs
from qruntime.engine.decode_rows import DECODE_ROWS_READS, MAX_ROWS, decode_rows
from qruntime.engine.mixed_graphs import MixedGraphs
from qruntime.engine.piecewise_graphs import PiecewiseGraphs
from qruntime.engine.sampled_tokens import resolve_pending
from qruntime.engine.sharded_sampler import VocabShard
from qruntime.engine.step_chunk import StepChunk
from qruntime.engine.step_rows import logit_rows, mrope_rows
from qruntime.engine.transfer import device_tensor, pack
from qruntime.kv_cache import KVCache
from qruntime.ops.base import AttentionMetadata, StepContext, TableSlots
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
        vocab_shard: VocabShard | None = None,
        mixed_graphs: MixedGraphs | None = None,
        mrope: bool = False,
        vision: tuple[int, torch.dtype] | None = None,
    ) -> None:
        self.plan = plan
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.spec.block_size
        self.max_context_len = max_context_len
        self.decode_graphs = decode_graphs
        self.piecewise_graphs = piecewise_graphs
        self.mixed_graphs = mixed_graphs
        # tp > 1 with a vocabulary-parallel head: `execute` returns this rank's columns of the logits,
        # which engine/sharded_sampler.py samples or gathers with the other ranks
        self.vocab_shard = vocab_shard
        # Qwen3-VL graphs (docs/vision.md): positions [3, T] (M-RoPE), and the image rows' embeddings
        # [Nv, width] of the compute dtype fed with their rows (Nv = 0 in a step without image tokens)
        self.mrope = mrope
        self.vision = vision
        # steps of short chunks whose rows read at most this many context positions run as decode rows
        # (engine/decode_rows.py; 0: never)
        self.decode_rows_reads, self.decode_rows_max = DECODE_ROWS_READS, MAX_ROWS
        # start-up work a load left for later (graphs captured at first use: qruntime.rank): the warm-up
        # steps, run by idle_work once every graph is captured
        self.warm_up: Callable[[], None] | None = None

    def has_idle_work(self) -> bool:
        return self.warm_up is not None or any(g is not None and g.pending for g in self._graphs())

    def idle_work(self) -> bool:
        """Do one piece of the start-up work a load left for later, for a caller with nothing to run:
        the largest bucket not captured yet of the decode graphs, then of the whole-step and the
        piecewise graphs, then the warm-up steps. Returns whether work is left. At tp > 1 every rank
        calls it at the same point in its steps (engine/workers.py): the graphs hold collectives."""
        for graphs in self._graphs():
            if graphs is not None and graphs.pending:
                graphs.capture(graphs.pending[-1])
                return self.has_idle_work()
        if self.warm_up is not None:
            warm_up, self.warm_up = self.warm_up, None
            warm_up()
        return self.has_idle_work()

    def _graphs(self) -> tuple[DecodeGraphs | MixedGraphs | PiecewiseGraphs | None, ...]:
        return self.decode_graphs, self.mixed_graphs, self.piecewise_graphs

    def drop_graphs(self) -> None:
        """Forget the captured graphs, decode, mixed and piecewise, once the device has finished with
        them (their memory pools go back to the allocator); steps after this run eagerly."""
        if any(g is not None for g in (self.decode_graphs, self.piecewise_graphs, self.mixed_graphs)):
            torch.cuda.synchronize(self.device)
            self.decode_graphs = self.piecewise_graphs = self.mixed_graphs = None
        self.warm_up = None

    def prepare(
        self, chunks: Sequence[StepChunk], all_logits: bool | Sequence[bool] = False
    ) -> tuple[dict[str, torch.Tensor], AttentionMetadata]:
        """Graph inputs (docs/OPS.md) and attention metadata for one step. logits_indices picks each
        chunk's last token, or with all_logits every token of the step; all_logits may also be one
        bool per chunk: every token of the chunks it marks, the last of the others (in step order).

        Built with numpy on the host (a handful of array ops whatever the step's size; only each
        chunk's ids and block table are walked in Python) and sent in two asynchronous copies, one
        per dtype (transfer.pack): a blocking copy would wait for the step still in flight."""
        bs, count = self.block_size, len(chunks)
        lens = np.fromiter((c.num_tokens for c in chunks), np.int64, count)
        starts = np.zeros(count + 1, np.int64)
        np.cumsum(lens, out=starts[1:])
        tokens = int(starts[-1])
        first = np.fromiter((c.start for c in chunks), np.int64, count)
        context_lens = first + lens
        seq = np.repeat(np.arange(count), lens)  # the chunk of every token of the step
        positions = np.arange(tokens) - starts[seq] + first[seq]
        tables = np.zeros((count, max(len(c.block_table) for c in chunks)), np.int32)
        for b, chunk in enumerate(chunks):
            tables[b, : len(chunk.block_table)] = chunk.block_table
        wide = {
            "input_ids": np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64, tokens),
            "positions": mrope_rows(chunks, positions, starts) if self.mrope else positions,
            "slot_mapping": tables[seq, positions // bs].astype(np.int64) * bs + positions % bs,
            "logits_indices": logit_rows(all_logits, lens, starts, seq),
        }
        if self.vision is not None:  # [Nv, 1]: the step's rows holding image tokens
            rows = [starts[b] + np.asarray(c.vision_rows, np.int64) for b, c in enumerate(chunks) if c.vision_rows]
            wide["vision_rows"] = (np.concatenate(rows) if rows else np.zeros(0, np.int64))[:, None]
        wide = pack(wide, self.device)
        narrow = pack(
            {
                "block_tables": tables,
                "context_lens": context_lens.astype(np.int32),
                "query_start_loc": starts.astype(np.int32),
            },
            self.device,
        )
        feeds = {**wide, **narrow}
        if self.vision is not None:
            feeds["vision_embeds"] = self._vision_embeds(chunks)
        lens_tuple = tuple(context_lens.tolist())
        meta = AttentionMetadata(
            query_start=tuple(starts.tolist()),
            context_lens=lens_tuple,
            cache_slots=TableSlots(feeds["block_tables"], lens_tuple, bs),
            max_q_len=int(lens.max()),
            max_context_len=self.max_context_len,
        )
        return feeds, meta

    def _vision_embeds(self, chunks: Sequence[StepChunk]) -> torch.Tensor:
        """vision_embeds [Nv, width]: the image rows' embeddings, in step order (already on the device)."""
        width, dtype = self.vision
        parts = [c.vision_embeds for c in chunks if c.vision_rows]
        if not parts:
            return torch.zeros((0, width), dtype=dtype, device=self.device)
        return torch.cat(parts).to(self.device, dtype)

    @torch.inference_mode()
    def execute(
        self,
        chunks: Sequence[StepChunk],
        all_logits: bool | Sequence[bool] = False,
        sampled: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the plan on the step's chunks; logits [len(chunks), V] of each chunk's last token
        (all_logits: [tokens, V], a row per token of the step; one bool per chunk: the rows
        `prepare` says). With captured graphs, decode steps replay a decode graph, and other steps
        that fit a token bucket a mixed graph or the piecewise graphs (whose logits tails run
        eagerly, on any rows).
        `sampled`: the previous step's sampled ids on the device, which the chunks' pending ids
        (step_chunk.pending) name by row. With a vocab_shard, the logits are this rank's columns."""
        every = all_logits if isinstance(all_logits, bool) else any(all_logits)
        images = any(c.vision_rows for c in chunks)  # graphs were captured without image rows: eager
        decode = self.decode_graphs
        if decode is not None and not every and not images and decode.fits(chunks, sampled):
            return decode.run(chunks, sampled)
        if decode is not None and not images:  # short chunks (verifications): one decode row per token
            rows = decode_rows(chunks, all_logits, self.decode_rows_reads, self.decode_rows_max)
            if rows is not None and decode.fits(rows.chunks, sampled):
                logits = decode.run(rows.chunks, sampled)
                return logits if rows.keep is None else logits[device_tensor(rows.keep, torch.int64, logits.device)]
        mixed = self.mixed_graphs
        if mixed is not None and all_logits is not True and not images and mixed.fits(chunks):
            return mixed.run(chunks, all_logits, sampled)
        feeds, meta = self.prepare(chunks, all_logits)
        if sampled is not None:
            feeds["input_ids"] = resolve_pending(feeds["input_ids"], sampled)
        if images:
            return self.plan.run(StepContext(self.kv_cache, meta), feeds)
        piecewise = self.piecewise_graphs
        if piecewise is not None and all_logits is not True and piecewise.fits(len(feeds["input_ids"])):
            return piecewise.run(feeds, meta)
        return self.plan.run(StepContext(self.kv_cache, meta), feeds)
