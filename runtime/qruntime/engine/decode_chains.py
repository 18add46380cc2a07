"""Several greedy decode steps replayed as one graph: a model draft's steps after its first.

A draft model (or a layer-skipping draft) decodes its k draft tokens one step at a time, each step
feeding the token the step before chose. Replayed one decode graph a step, each step costs the host
its inputs, a replay and a sampling call: on the H200 a 4-layer 28M draft's 4 steps took 1.07 ms of
host for ~0.5 ms of kernels (bench/results/spec_step_profile_trained_ac7551a_h200.json), so the GPU
waited. A chain captures `steps` decode steps of a batch bucket in one graph: each step's argmax is
the next step's token, on the device. Everything else a step reads is known before the first: the
host stages the first step's rows as for a decode graph and every later step's positions, KV slots
(from the block tables) and context lengths at once, replays once, and reads every step's tokens in
one copy. (Advancing them on the device instead cost ~14 small kernels a step, 444 kernels a round
against 375 stepping, and more GPU time than the host time it saved: c2cb6a7 on an H200.)

Row b runs `remaining[b]` steps: after its last it stays at its last position and writes its KV to
the scratch block, so requests drafting different k share one replay without writing past what
their tables hold. A row's tokens come back with each step's maximum logit (its `peak`: NaN or inf where the
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

import numpy as np
import torch

from qruntime.engine.cuda_graphs import DecodeGraphs
from qruntime.ops.base import StepContext

if TYPE_CHECKING:
    from qruntime.engine.step_chunk import StepChunk


MAX_STEPS = 16  # a chain's steps (a draft's k - 1; k is at most speculative.config.MAX_DRAFT_TOKENS)


class DecodeChains:
    """Chains of greedy decode steps over `graphs`' buffers; `run` stages, replays and returns."""

    def __init__(self, graphs: DecodeGraphs) -> None:
        if graphs.inputs.mrope:
            raise ValueError("decode chains advance 1-D positions; an M-RoPE graph's [3, B] positions are not")
        self.graphs = graphs
        device, size = graphs.sampled.device, graphs.buckets[-1]
        cuda = device.type == "cuda"
        # the inputs of steps 1.. (step 0's are the decode graphs'), written by the host: positions and
        # KV slots [2, MAX_STEPS - 1, size], context lengths [MAX_STEPS - 1, size]
        self._wide_host = torch.zeros(2, MAX_STEPS - 1, size, dtype=torch.int64, pin_memory=cuda)
        self._lens_host = torch.ones(MAX_STEPS - 1, size, dtype=torch.int32, pin_memory=cuda)
        self._wide_host[1].fill_(graphs.scratch_block * graphs.block_size)
        self.wide, self.lens = self._wide_host.to(device), self._lens_host.to(device)
        self._copied = torch.cuda.Event() if cuda else None  # the last run's copies of the host buffers
        self.chains: dict[tuple[int, int], tuple[Callable[[], None], torch.Tensor, torch.Tensor]] = {}

    def fits(self, chunks: Sequence[StepChunk], sampled: torch.Tensor | None = None) -> bool:
        return bool(chunks) and self.graphs.fits(chunks, sampled)

    def run_fitting(
        self, chunks: Sequence[StepChunk], remaining: Sequence[int], sampled: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`run`, where the chunks fit the graphs (speculative.draft.decode_drafts' chain); None elsewhere."""
        return self.run(chunks, remaining, sampled) if self.fits(chunks, sampled) else None

    @torch.inference_mode()
    def run(
        self, chunks: Sequence[StepChunk], remaining: Sequence[int], sampled: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and peaks [max(remaining), len(chunks)] of greedy decode steps from `chunks` (one
        token each; pending ids read `sampled`), row b's first remaining[b] entries its own (>= 1 each);
        the rest of a column is the output of a row that stopped, to be dropped."""
        if len(remaining) != len(chunks) or min(remaining, default=0) < 1 or max(remaining) > MAX_STEPS:
            raise ValueError(f"each of the {len(chunks)} rows runs 1..{MAX_STEPS} steps (remaining {list(remaining)})")
        steps, batch, graphs = max(remaining), len(chunks), self.graphs
        bucket = graphs.buckets[bisect_left(graphs.buckets, batch)]
        if (bucket, steps) not in self.chains:
            self.capture(bucket, steps)
        graphs.stage(chunks, sampled)
        if steps > 1:
            self._stage_steps(chunks, remaining, bucket, steps)
        replay, ids, peaks = self.chains[bucket, steps]
        replay()
        return ids[:, :batch], peaks[:, :batch]

    def _stage_steps(self, chunks: Sequence[StepChunk], remaining: Sequence[int], bucket: int, steps: int) -> None:
        """Write steps 1..steps-1's positions, KV slots and context lengths: a row still running is at
        its next position, in the slot its block table gives; a row that ran its steps stays at its
        last position and writes the scratch block; padding rows too."""
        if self._copied is not None:
            self._copied.synchronize()  # the last run's copies have read the host buffers
        graphs, n = self.graphs, len(chunks)
        size, scratch = graphs.block_size, graphs.scratch_block * graphs.block_size
        later = np.arange(1, steps)[:, None]  # [steps - 1, 1]
        left = np.asarray(remaining, np.int64)[None, :]
        starts = np.fromiter((c.start for c in chunks), np.int64, n)[None, :]
        running = later < left
        positions = starts + np.minimum(later, left - 1)
        tables = graphs.inputs.tensors["block_tables"].numpy()[:n]  # as stage() wrote them
        blocks = np.take_along_axis(tables, np.minimum(positions // size, tables.shape[1] - 1).T, axis=1).T
        wide, lens = self._wide_host.numpy(), self._lens_host.numpy()
        wide[0, : steps - 1, :n] = positions
        wide[1, : steps - 1, :n] = np.where(running, blocks.astype(np.int64) * size + positions % size, scratch)
        lens[: steps - 1, :n] = positions + 1
        wide[0, : steps - 1, n:bucket], wide[1, : steps - 1, n:bucket], lens[: steps - 1, n:bucket] = 0, scratch, 1
        self.wide[:, : steps - 1].copy_(self._wide_host[:, : steps - 1], non_blocking=True)
        self.lens[: steps - 1].copy_(self._lens_host[: steps - 1], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    @torch.inference_mode()
    def capture(self, bucket: int, steps: int) -> None:
        """Capture the chain of `steps` steps of bucket `bucket` (again if it has one), on padding rows
        alone (staged as a decode graph's capture is: stale rows would write real sequences' KV)."""
        graphs = self.graphs
        graphs.stage_padding(bucket)
        if self._copied is not None:
            self._copied.synchronize()
        self.wide[0].zero_()
        self.wide[1].fill_(graphs.scratch_block * graphs.block_size)
        self.lens.fill_(1)
        first = graphs.feeds(bucket)
        context = StepContext(graphs.kv_cache, graphs.meta)

        def body() -> dict[str, torch.Tensor]:
            ids, peaks = [], []
            for step in range(steps):
                if step:  # the token chosen, and the host's positions, slots and lengths of this step
                    feeds = {
                        **first,
                        "input_ids": ids[-1],
                        "positions": self.wide[0, step - 1, :bucket],
                        "slot_mapping": self.wide[1, step - 1, :bucket],
                        "context_lens": self.lens[step - 1, :bucket],
                    }
                else:
                    feeds = graphs.resolved(first)
                peak, token = graphs.plan.run(context, feeds).max(-1)
                ids.append(token)
                peaks.append(peak)
            return {"ids": torch.stack(ids), "peaks": torch.stack(peaks)}

        outputs, replay = graphs.capturer(body)
        self.chains[bucket, steps] = replay, outputs["ids"], outputs["peaks"]
