"""Decode steps replayed from CUDA graphs, one per batch-size bucket, with static input buffers.

A decode step (one new token per sequence) has the same shapes for every batch of the same size, so
the whole plan is captured once per bucket and replayed: the host launches one graph instead of
thousands of kernels. Batches are padded up to their bucket with rows that write a scratch KV block
no sequence owns and read only that block. Captured graphs share one memory pool. At tp > 1 every
rank captures the same buckets in the same order (the graphs hold the all-reduces, which must pair
up across ranks) and replays the same bucket each step. A row's token id may be pending (sampled by
the step before, still on the device: async scheduling): the graphs read those from a buffer the
previous step's sampled ids are copied into, inside the graph (sampled_tokens.resolve_pending).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from qruntime.engine.decode_inputs import DecodeInputs
from qruntime.engine.graph_capture import Capture, cuda_capture
from qruntime.engine.sampled_tokens import resolve_pending
from qruntime.kv_cache import KVCache
from qruntime.ops.base import AttentionMetadata, StepContext
from qruntime.plan import Plan

if TYPE_CHECKING:
    from qruntime.engine.step_chunk import StepChunk

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    """Captured decode graphs for batch sizes `buckets`; `run(chunks)` pads, copies and replays."""

    def __init__(
        self,
        plan: Plan,
        kv_cache: KVCache,
        scratch_block: int,
        max_context_len: int,
        buckets: Sequence[int],
        max_sampled: int = 0,
        mrope: bool = False,
        vision: tuple[int, torch.dtype] | None = None,
        *,
        capture: Capture | None = None,
        lazy: bool = False,
    ) -> None:
        """mrope, vision: a Qwen3-VL graph's positions [3, B] and its image-row inputs, fed empty (a decode
        row is never an image token: ModelRunner runs steps with image rows eagerly). capture: CUDA
        graphs in one new pool by default (graph_capture.py; eager_capture runs anywhere). lazy:
        capture no bucket now; each is captured at its first step (or by capture())."""
        self.plan, self.kv_cache = plan, kv_cache
        self.buckets = tuple(sorted(buckets))
        self.block_size = kv_cache.spec.block_size
        self.scratch_block = scratch_block
        self.max_blocks = -(-max_context_len // self.block_size)
        self.meta = AttentionMetadata((), (), (), max_q_len=1, max_context_len=max_context_len)
        device, size = kv_cache.k[0].device, self.buckets[-1]
        cuda = device.type == "cuda"
        self.inputs = DecodeInputs(size, self.max_blocks, self.block_size, scratch_block, pin=cuda, mrope=mrope)
        self.wide, self.narrow = self.inputs.twin(device)  # the buffers the graphs read, as views below
        self.buffers = {
            **self.inputs.views(self.wide, self.narrow),
            "query_start_loc": torch.arange(size + 1, dtype=torch.int32, device=device),
            "logits_indices": torch.arange(size, dtype=torch.int64, device=device),
        }
        if vision is not None:
            width, dtype = vision
            self.buffers["vision_rows"] = torch.zeros((0, 1), dtype=torch.int64, device=device)
            self.buffers["vision_embeds"] = torch.zeros((0, width), dtype=dtype, device=device)
        # the previous step's sampled ids, for pending rows: as many as a step samples (max_sampled)
        self.sampled = torch.zeros(max(size, max_sampled), dtype=torch.int64, device=device)
        # recorded after each step's copies out of self.inputs (on CPU the copies are done on return)
        self.copied = torch.cuda.Event() if cuda else None
        # how graphs are captured, in this instance's pool (decode_chains.py captures in it too)
        self.capturer = capture if capture is not None else cuda_capture(torch.cuda.graph_pool_handle())
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        for batch in () if lazy else reversed(self.buckets):  # largest first: the smaller ones reuse its memory
            self.capture(batch)

    @property
    def pending(self) -> tuple[int, ...]:
        """The buckets not captured yet (a lazy instance's), smallest first."""
        return tuple(b for b in self.buckets if b not in self.graphs)

    def feeds(self, batch: int) -> dict[str, torch.Tensor]:
        """The graph inputs of a batch of `batch` rows: views of the buffers."""
        feeds = {name: buf[..., :batch] if name == "positions" else buf[:batch] for name, buf in self.buffers.items()}
        feeds["query_start_loc"] = self.buffers["query_start_loc"][: batch + 1]
        return feeds

    @torch.inference_mode()
    def capture(self, batch: int) -> None:
        """Capture the graph of bucket `batch` (again if it has one) on padding rows alone. A capture at
        first use comes after other steps, whose rows the buffers still hold: the capture's warm-up
        runs would otherwise write those sequences' KV from stale token ids."""
        self.stage_padding(batch)
        step, feeds = StepContext(self.kv_cache, self.meta), self.feeds(batch)
        outputs, replay = self.capturer(lambda: {"logits": self.plan.run(step, self.resolved(feeds))})
        self.graphs[batch] = replay, outputs["logits"]

    def stage_padding(self, batch: int) -> None:
        """Make the buffers' first `batch` rows padding rows (a capture's inputs), synchronously."""
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copies have read the host buffers
        self.inputs.fill((), batch)
        wide, narrow = self.inputs.spans(batch)
        self.wide.copy_(wide)
        self.narrow[: narrow.numel()].copy_(narrow)

    def replay_of(self, batch: int) -> Callable[[], None]:
        """The replay of bucket `batch`'s graph on whatever its buffers hold (benches time it alone),
        captured first if it is not yet."""
        if batch not in self.graphs:
            self.capture(batch)
        return self.graphs[batch][0]

    def resolved(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`feeds` with its pending ids read from `sampled` (on the device: inside a graph)."""
        return {**feeds, "input_ids": resolve_pending(feeds["input_ids"], self.sampled)}

    def fits(self, chunks: Sequence[StepChunk], sampled: torch.Tensor | None = None) -> bool:
        return (
            len(chunks) <= self.buckets[-1]
            and all(c.num_tokens == 1 for c in chunks)
            and (sampled is None or sampled.numel() <= self.sampled.numel())
        )

    def stage(self, chunks: Sequence[StepChunk], sampled: torch.Tensor | None = None) -> int:
        """Write a decode step's rows (padded to their bucket, which is returned) into the buffers the
        graphs read, and `sampled` (the previous step's sampled ids, which pending rows read) beside
        them; the bucket's graph is captured first if it is not yet."""
        batch = len(chunks)
        bucket = self.buckets[bisect_left(self.buckets, batch)]
        if bucket not in self.graphs:  # captured at first use, before the step's rows are written
            self.capture(bucket)
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copies have read the host buffers (at once: it sampled)
        self.inputs.fill(chunks, bucket)
        wide, narrow = self.inputs.spans(bucket)
        self.wide.copy_(wide, non_blocking=True)  # pinned: asynchronous
        self.narrow[: narrow.numel()].copy_(narrow, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if sampled is not None:
            self.sampled[: sampled.numel()].copy_(sampled)
        return bucket

    @torch.inference_mode()
    def run(self, chunks: Sequence[StepChunk], sampled: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(chunks), V] of a decode step; `sampled`: the previous step's sampled ids, which
        pending rows read."""
        replay, logits = self.graphs[self.stage(chunks, sampled)]
        replay()
        return logits[: len(chunks)]
