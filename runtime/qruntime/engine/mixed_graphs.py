"""Prefill and mixed steps replayed whole from one CUDA graph per token bucket.

Piecewise graphs (piecewise_graphs.py) run attention eagerly between the captured pieces, because its
grids come from the step's sequences. That costs the host a launch or three per layer and a replay per
piece: a 64-token chunk beside one decode took 14.6 ms of host time for 7.6 ms of kernels (H100,
qwen3-8b, 36 layers). Here attention launches from bounds instead (AttentionMetadata.bounds_only,
Op.launches_from_bounds): its grids are sized by the bucket's token count and max_num_seqs, and its
programs read their sequence and query tile from a work list the host writes before each replay
(Op.bounds_work: a few numpy ops per step, one small copy, read by every layer;
kernels/paged_prefill_attention.py bounds_work), so everything up to the logits gather is captured
once per bucket and a step is one replay. The tail from the logits gather on runs eagerly, as in the
piecewise graphs (its rows are the step's sequences). A first version had each program find its work
by scanning query_start_loc itself: 0.3-2 ms more GPU time a step than the piecewise graphs (H200,
qwen3-8b, 36 layers), the scans of the thousands of programs a bound-sized grid holds.

Static inputs: the token inputs as the piecewise graphs pad them (rows n..T-1 take token 0 at position
0 and write the scratch block); the sequence inputs in buffers of max_num_seqs rows, the step's B
sequences first and the others empty (q_len 0: query_start_loc repeats n; context 0), whatever they
held before (no kernel reads an empty sequence's block table). Attention zeroes the padding rows'
output, so the ops after it see finite rows there.

A step goes to the piecewise graphs instead when its attention op prefers an eager launch (fresh long
prompts, which cuDNN's attention runs faster: ops/triton_ops.py PagedAttention.prefers_eager).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from qruntime.engine.graph_capture import Capture, cuda_capture
from qruntime.engine.mixed_inputs import TOKEN_NAMES, MixedInputs
from qruntime.engine.piecewise_graphs import qwen3_vl_inputs, smallest_bucket, unfit_reason
from qruntime.engine.sampled_tokens import resolve_pending
from qruntime.engine.step_chunk import StepChunk
from qruntime.kv_cache import KVCache
from qruntime.ops.base import AttentionMetadata, StepContext, TableSlots
from qruntime.plan import GRAPH_INPUTS, Plan


def mixed_unfit_reason(plan: Plan) -> str | None:
    """Why `plan` cannot run as mixed graphs, or None when it can."""
    reason = unfit_reason(plan)
    if reason is not None:
        return reason
    for piece in plan.pieces()[:-1]:
        for node in plan.nodes[piece.start : piece.stop]:
            if piece.eager and not node.op.launches_from_bounds:
                return f"node {node.name!r} ({type(node.op).__name__}) runs only on the step's own sequences"
    return None


class MixedGraphs:
    """Whole-step graphs of `plan` for token counts up to max(buckets) and at most max_seqs sequences;
    `run(chunks)` writes the step into the static inputs and replays the bucket (see the module
    docstring). `capture` defaults to CUDA graphs in one new pool (cuda_capture); eager_capture runs
    anywhere."""

    def __init__(
        self,
        plan: Plan,
        kv_cache: KVCache,
        buckets: Sequence[int],
        scratch_block: int,
        max_context_len: int,
        max_seqs: int,
        capture: Capture | None = None,
        mrope: bool = False,
        vision: tuple[int, torch.dtype] | None = None,
        *,
        lazy: bool = False,
    ) -> None:
        """lazy: capture no bucket now; each is captured at its first step (or by capture())."""
        reason = mixed_unfit_reason(plan)
        if reason is not None:
            raise ValueError(f"this plan cannot run as mixed-step CUDA graphs: {reason}")
        if not buckets or min(buckets) < 1 or max_seqs < 1:
            raise ValueError(f"token buckets and max_seqs must be positive, got {list(buckets)} and {max_seqs}")
        self.plan, self.kv_cache = plan, kv_cache
        self.buckets, self.max_seqs = tuple(sorted(set(buckets))), max_seqs
        self.max_context_len = max_context_len
        self.tail = plan.pieces()[-1]
        self.attention = [node.op for node in plan.nodes[: self.tail.start] if node.op.splits_graph]
        device = kv_cache.k[0].device
        block_size = kv_cache.spec.block_size
        # the attention kernels' work list, rewritten before each replay (Op.bounds_work); zeros: no work
        work = max((op.bounds_work_size(b, max_seqs) for op in self.attention[:1] for b in self.buckets), default=0)
        size = self.buckets[-1]
        self.host = MixedInputs(
            size,
            max_seqs,
            -(-max_context_len // block_size),
            work,
            block_size,
            scratch_block,
            device.type == "cuda",
            mrope,
        )
        self.wide, self.narrow = self.host.twin(device)  # the buffers the graphs read, as views below
        views = self.host.views(self.wide, self.narrow)
        self.work, self.logits_indices = views.pop("work"), views.pop("logits_indices")
        self.inputs = {**views, **qwen3_vl_inputs(size, device, False, vision)}
        self.meta = AttentionMetadata((), (), (), max_context_len=max_context_len, bounds_only=True, work=self.work)
        self.padding = {"input_ids": 0, "positions": 0, "slot_mapping": scratch_block * block_size}
        self.scratch_block = scratch_block
        # recorded after each step's copies out of the host buffers (on CPU the copies are done on return)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self._capture_with = capture if capture is not None else cuda_capture(torch.cuda.graph_pool_handle())
        self.graphs: dict[int, tuple[dict[str, torch.Tensor], object]] = {}
        for bucket in () if lazy else reversed(self.buckets):  # largest first: the smaller ones reuse its memory
            self.capture(bucket)

    @property
    def pending(self) -> tuple[int, ...]:
        """The buckets not captured yet (a lazy instance's), smallest first."""
        return tuple(b for b in self.buckets if b not in self.graphs)

    @torch.inference_mode()
    def capture(self, bucket: int) -> None:
        """Capture `bucket`'s graph (again if it has one) on the inputs of no sequence: padding token rows
        (the scratch block), empty sequences, no attention work. A capture at first use comes after
        other steps, whose rows and sequences the buffers still hold: the capture's warm-up runs would
        otherwise write those sequences' KV from stale inputs."""
        for name, pad in self.padding.items():
            self.inputs[name].fill_(pad)
        self.inputs["block_tables"].fill_(self.scratch_block)
        self.inputs["context_lens"].zero_()
        self.inputs["query_start_loc"].zero_()
        self.work.zero_()
        self.graphs[bucket] = self._capture(bucket, self._capture_with)

    def bucket_for(self, tokens: int) -> int | None:
        return smallest_bucket(self.buckets, tokens)

    def fits(self, chunks: Sequence[StepChunk]) -> bool:
        """Whether a step replays a mixed graph: its tokens, sequences and block tables fit, and its
        attention does not prefer an eager launch (fresh long prompts)."""
        tokens = sum(c.num_tokens for c in chunks)
        if not (
            0 < tokens <= self.buckets[-1]
            and len(chunks) <= self.max_seqs
            and all(len(c.block_table) <= self.host.max_blocks for c in chunks)
        ):
            return False
        if not self.attention:
            return True
        starts = (0, *accumulate(c.num_tokens for c in chunks))
        meta = AttentionMetadata(starts, tuple(c.start + c.num_tokens for c in chunks), ())
        return not self.attention[0].prefers_eager(meta)  # every layer's op decides alike

    def _feeds(self, bucket: int) -> dict[str, torch.Tensor]:
        return {name: buf[..., :bucket] if name in self.padding else buf for name, buf in self.inputs.items()}

    def _capture(self, bucket: int, capture: Capture):
        plan, stop = self.plan, self.tail.start
        step, feeds = StepContext(self.kv_cache, self.meta), self._feeds(bucket)
        wanted = [name for name in self.tail.reads if name not in plan.weights and name not in GRAPH_INPUTS]

        def run_body() -> dict[str, torch.Tensor]:
            env = {**plan.weights, **feeds, "": None}
            plan.run_nodes(step, env, 0, stop)
            return {name: env[name] for name in wanted}

        return capture(run_body)

    @torch.inference_mode()
    def run(
        self,
        chunks: Sequence[StepChunk],
        all_logits: bool | Sequence[bool] = False,
        sampled: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of a step that fits (the caller asked `fits`): each chunk's last row, or with
        all_logits (one bool per chunk) every row of the chunks it marks (ModelRunner.prepare's rows).
        `sampled`: the previous step's sampled ids, which the chunks' pending ids name by row."""
        tokens, seqs = sum(c.num_tokens for c in chunks), len(chunks)
        bucket = self.bucket_for(tokens)
        if bucket is None or seqs > self.max_seqs:
            raise ValueError(f"a step of {tokens} tokens and {seqs} sequences fits no mixed graph")
        if bucket not in self.graphs:  # before the step's inputs are written: the capture resets them
            self.capture(bucket)
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copies have read the host buffers
        step = self.host.fill(chunks, bucket, all_logits)
        tables = self.inputs["block_tables"][:seqs]
        meta = AttentionMetadata(
            step.query_start,
            step.context_lens,
            TableSlots(tables, step.context_lens, self.kv_cache.spec.block_size),
            max_q_len=step.max_q_len,
            max_context_len=self.max_context_len,
        )
        if self.attention:
            work = self.attention[0].bounds_work(meta, bucket, self.max_seqs)
            self.host.arrays["work"][: work.size] = work
        wide, narrow = self.host.spans(seqs)
        self.wide.copy_(wide, non_blocking=True)  # pinned: asynchronous
        self.narrow[: narrow.numel()].copy_(narrow, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        inputs = self.inputs
        if sampled is not None:
            ids = inputs["input_ids"][:tokens]
            ids.copy_(resolve_pending(ids, sampled))
        outputs, replay = self.graphs[bucket]
        replay()
        feeds = {name: inputs[name][..., :tokens] for name in TOKEN_NAMES}
        feeds |= {
            "logits_indices": self.logits_indices[: step.logit_rows],
            "block_tables": tables,
            "context_lens": inputs["context_lens"][:seqs],
            "query_start_loc": inputs["query_start_loc"][: seqs + 1],
        }
        tail = self.tail
        env = {**self.plan.weights, "": None}
        env.update((name, feeds[name]) for name in tail.reads if name in feeds)
        env.update((name, value[:tokens]) for name, value in outputs.items())
        self.plan.run_nodes(StepContext(self.kv_cache, meta), env, tail.start, tail.stop)
        return env[self.plan.output]
