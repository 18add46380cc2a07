"""Several greedy decode steps replayed as one graph: a model draft's steps after its first.

A draft model (or a layer-skipping draft) decodes its k draft tokens one step at a time, each step
feeding the token the step before chose. Replayed one decode graph a step, each step costs the host
its inputs, a replay and a sampling call: on the H200 a 4-layer 28M draft's 4 steps took 1.07 ms of
host for ~0.5 ms of kernels (bench/results/spec_step_profile_trained_ac7551a_h200.json), so the GPU
waited. A chain captures `steps` decode steps of a batch bucket in one graph, with what the host did
between them done on the device: each step's argmax is the next step's token, and the positions,
context lengths and KV slots (read from the block tables) advance by one. The host stages the first
step's rows as for a decode graph, replays once, and reads every step's tokens in one copy.

Row b runs `remaining[b]` steps: after its last it stops advancing and writes its KV to the scratch
block, so requests drafting different k share one replay without writing past what their tables
hold. A row's tokens come back with each step's maximum logit (its `peak`: NaN or inf where the
logits were not finite, as sampled_tokens.SampledTokens reads them).

Chains are captured per (bucket, steps) at first use, in the decode graphs' pool (their capturer),
over the decode graphs' buffers: a chain's replay and a decode graph's may not interleave (the
engine's steps do not). Greedy only: a sampled draft token needs its generator and its distribution,
drawn per step (speculative/draft.decode_drafts falls back to stepping).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from qruntime.engine.cuda_graphs import DecodeGraphs
from qruntime.ops.base import StepContext

if TYPE_CHECKING:
    from qruntime.engine.step_chunk import StepChunk


class DecodeChains:
    """Chains of greedy decode steps over `graphs`' buffers; `run` stages, replays and returns."""

    def __init__(self, graphs: DecodeGraphs) -> None:
        if graphs.inputs.mrope:
            raise ValueError("decode chains advance 1-D positions; an M-RoPE graph's [3, B] positions are not")
        self.graphs = graphs
        device, size = graphs.sampled.device, graphs.buckets[-1]
        cuda = device.type == "cuda"
        self.remaining = torch.zeros(size, dtype=torch.int64, device=device)
        self._remaining_host = torch.zeros(size, dtype=torch.int64, pin_memory=cuda)
        self._copied = torch.cuda.Event() if cuda else None  # the last run's copy of _remaining_host
        self.chains: dict[tuple[int, int], tuple[Callable[[], None], torch.Tensor, torch.Tensor]] = {}

    def fits(self, chunks: Sequence[StepChunk], sampled: torch.Tensor | None = None) -> bool:
        return bool(chunks) and self.graphs.fits(chunks, sampled)

    @torch.inference_mode()
    def run(
        self, chunks: Sequence[StepChunk], remaining: Sequence[int], sampled: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and peaks [max(remaining), len(chunks)] of greedy decode steps from `chunks` (one
        token each; pending ids read `sampled`), row b's first remaining[b] entries its own (>= 1 each);
        the rest of a column is the output of a row that stopped, to be dropped."""
        if len(remaining) != len(chunks) or min(remaining, default=0) < 1:
            raise ValueError(f"each of the {len(chunks)} rows runs at least one step (remaining {list(remaining)})")
        steps, batch, graphs = max(remaining), len(chunks), self.graphs
        bucket = graphs.buckets[bisect_left(graphs.buckets, batch)]
        if (bucket, steps) not in self.chains:
            self.capture(bucket, steps)
        graphs.stage(chunks, sampled)
        if self._copied is not None:
            self._copied.synchronize()  # the last run's copy has read the host buffer
        host = self._remaining_host
        host[:batch] = torch.as_tensor(remaining, dtype=torch.int64)
        host[batch:bucket] = 0  # padding rows: scratch from the first step on
        self.remaining[:bucket].copy_(host[:bucket], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        replay, ids, peaks = self.chains[bucket, steps]
        replay()
        return ids[:, :batch], peaks[:, :batch]

    @torch.inference_mode()
    def capture(self, bucket: int, steps: int) -> None:
        """Capture the chain of `steps` steps of bucket `bucket` (again if it has one), on padding rows
        alone (staged as a decode graph's capture is: stale rows would write real sequences' KV)."""
        graphs = self.graphs
        graphs.stage_padding(bucket)
        self.remaining.zero_()
        feeds = graphs.feeds(bucket)
        context = StepContext(graphs.kv_cache, graphs.meta)

        def body() -> dict[str, torch.Tensor]:
            ids, peaks = [], []
            for step in range(steps):
                if step:
                    self._advance(feeds, bucket, step, ids[-1])
                peak, token = graphs.plan.run(context, graphs.resolved(feeds)).max(-1)
                ids.append(token)
                peaks.append(peak)
            return {"ids": torch.stack(ids), "peaks": torch.stack(peaks)}

        outputs, replay = graphs.capturer(body)
        self.chains[bucket, steps] = replay, outputs["ids"], outputs["peaks"]

    def _advance(self, feeds: dict[str, torch.Tensor], bucket: int, step: int, tokens: torch.Tensor) -> None:
        """Make the buffers hold step `step`'s rows (in place, on the device): a row still running takes
        the token it chose at its next position, whose KV slot its block table gives; a row that ran
        its steps keeps its position and writes the scratch block."""
        graphs = self.graphs
        size = graphs.block_size
        running = self.remaining[:bucket] > step
        feeds["input_ids"].copy_(tokens)
        positions, lens = feeds["positions"], feeds["context_lens"]
        positions.add_(running.to(positions.dtype))
        lens.add_(running.to(lens.dtype))
        block = (positions // size).clamp_(max=graphs.max_blocks - 1)
        table = feeds["block_tables"].gather(1, block[:, None].to(torch.int64))[:, 0].to(torch.int64)
        scratch = torch.full_like(positions, graphs.scratch_block * size)
        feeds["slot_mapping"].copy_(torch.where(running, table * size + positions % size, scratch))
