"""Steps that are not pure decode, replayed from piecewise CUDA graphs: one set per token-count bucket.

A step with prefill chunks cannot be captured whole: attention's work depends on each sequence's
query start, context length and block table. Every other op depends on the step's token count
alone, so the plan is cut at the graph-splitting ops (Op.splits_graph, plan.Piece): the pieces
between them are captured once per bucket T, each as its own CUDA graph, and at every step the
pieces replay while attention runs eagerly between them, on the step's real rows and metadata, its
output copied into the static buffer the next piece reads (as vLLM's piecewise graphs do).

The tail from the logits gather on runs eagerly too: its rows are the step's sequences, a number no
bucket fixes. Capturing it would take a logits_indices buffer of fixed length and an lm_head GEMM
over that many rows every step (qwen3-8b: 4096 x 151936 per row), for the three launches it saves.

Padding: a step of n tokens runs the smallest bucket T >= n. Rows n..T-1 take token 0 at position 0
and write their KV to the scratch block no sequence owns (the one DecodeGraphs' padding rows write);
attention runs on the n real rows only, so nothing reads them. Every op of a piece must be row-wise
(Op.row_wise; a per-tensor activation scale is not, and such a plan gets no piecewise graphs), so a
padding row cannot change a real one; the MoE routes the padding rows too, which only adds work.

Buckets (token_buckets): the tuner's token buckets from 128 (qcompile/tune/gemm.py TOKEN_BUCKETS,
powers of two, each running the GEMM configs tuned at its exact size), a bucket half-way between
each two of them (192, 384, 768, 1536, ...), and max_num_batched_tokens as the last, so every step the
scheduler forms fits one. Smaller steps pad up to 128, where the GEMMs still cost about what reading
the weights costs (H100, qwen3-8b's 4096x4096 FP8 GEMM: 10.6 us at 1 token, 13.0 at 128, 14.4 at
256). Above ~512 tokens a step is compute-bound and the padding costs its share: with powers of two
alone, 23 prompts of 64 tokens beside 5 decodes (1,477 tokens) ran the 2048 bucket, 22.6 ms of
GEMMs (H100, qwen3-8b: bench/step_kernels.py); the halves bound the padding by a third rather than
by double. A speculating engine adds VERIFY_BUCKETS below 128: its verification steps hold k + 1
tokens a decoding request (5 at batch 1 with 4 drafts), which the 128 bucket ran at ~1.5x a decode
step's GPU time (H200, qwen3-0.6b synthetic: bench/spec_step_profile.py). Each size costs its
captures; their memory is mostly shared (Memory, below).

Memory: the graphs of every bucket share one pool, the largest bucket captured first. A piece's
output that only later pieces read is let go once they are captured, so later captures reuse its
memory (a bucket's pieces replay in the order they were captured, and buckets never interleave).
What eager code touches at replay lives in static buffers outside the pool, of max(buckets) rows,
one per shape among the values alive at once, shared by every bucket and layer: the outputs of
eager pieces are copied into them, and a captured piece copies what eager code reads after it
(attention's inputs, the tail's hidden rows) into them as its last kernels. Holding those inputs
in the pool instead, a bucket's own for every layer, took 36 layers x 8 KiB of q a token on
qwen3-8b: 1.1 GiB for the buckets 128, 256, ..., 2048 (bench/piecewise_check.py, H100), and
computed, 1.9 GiB with the halves between them and 7.8 GiB up to 8192: about all of the 10% the
KV sizing leaves free on an 80 GB GPU. At tp > 1 every rank captures the same buckets in the same
order and replays the same bucket each step (the pieces hold the all-reduces, which must pair up).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from qruntime.engine.graph_capture import Capture, Outputs, cuda_capture
from qruntime.kv_cache import KVCache
from qruntime.ops.base import AttentionMetadata, StepContext
from qruntime.plan import SEQUENCE_INPUTS, Piece, Plan

TOKEN_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192)  # qcompile/tune/gemm.py TOKEN_BUCKETS from 128
VERIFY_BUCKETS = (8, 16, 32, 64)  # a speculating engine's: verification steps of a few requests


def smallest_bucket(buckets: Sequence[int], tokens: int) -> int | None:
    """The smallest of the sorted `buckets` of at least `tokens` tokens, None when none is that large."""
    index = bisect_left(buckets, tokens)
    return buckets[index] if index < len(buckets) else None


def token_buckets(max_num_batched_tokens: int, verify: bool = False) -> tuple[int, ...]:
    """The default buckets (see the module docstring): TOKEN_BUCKETS and the sizes half-way between
    them (and VERIFY_BUCKETS when `verify`: a speculating engine), below max_num_batched_tokens, then
    max_num_batched_tokens."""
    sizes = {*TOKEN_BUCKETS, *(a + (b - a) // 2 for a, b in zip(TOKEN_BUCKETS, TOKEN_BUCKETS[1:], strict=False))}
    sizes |= set(VERIFY_BUCKETS) if verify else set()
    return (*sorted(t for t in sizes if t < max_num_batched_tokens), max_num_batched_tokens)


def unfit_reason(plan: Plan) -> str | None:
    """Why `plan` cannot run as piecewise graphs, or None when it can."""
    pieces = plan.pieces()
    for piece in (p for p in pieces if not p.eager):
        for node in plan.nodes[piece.start : piece.stop]:
            if not node.op.capturable:
                return f"node {node.name!r} ({type(node.op).__name__}) cannot be captured in a CUDA graph"
            if not node.op.row_wise:
                return f"node {node.name!r} ({type(node.op).__name__}) mixes rows: padding rows would change real ones"
    if not pieces or not pieces[-1].eager or plan.output not in pieces[-1].writes:
        return "the plan's output does not come from an eager tail (the logits gather and what follows it)"
    return None


@dataclass(frozen=True)
class EagerPiece:
    """What an eager piece reads and writes at replay, in one bucket."""

    piece: Piece
    rows: Mapping[str, torch.Tensor]  # token-indexed tensors it reads, [bucket, ...]: sliced to the step's tokens
    weights: Mapping[str, torch.Tensor]
    sequences: tuple[str, ...]  # the SEQUENCE_INPUTS it reads: the step's own
    into: Mapping[str, torch.Tensor]  # [bucket, ...] static buffer of each output a later piece reads


def qwen3_vl_inputs(
    size: int, device: torch.device, mrope: bool, vision: tuple[int, torch.dtype] | None
) -> dict[str, torch.Tensor]:
    """A Qwen3-VL graph's static inputs beyond Qwen3's: positions [3, size] (M-RoPE; padding rows at 0)
    in place of [size], and empty image rows (vision_rows [0, 1], vision_embeds [0, width]), the
    ScatterNDs then launching nothing. A step with image rows runs eagerly (ModelRunner.execute)."""
    inputs = {}
    if mrope:
        inputs["positions"] = torch.zeros((3, size), dtype=torch.int64, device=device)
    if vision is not None:
        width, dtype = vision
        inputs["vision_rows"] = torch.zeros((0, 1), dtype=torch.int64, device=device)
        inputs["vision_embeds"] = torch.zeros((0, width), dtype=dtype, device=device)
    return inputs


class PiecewiseGraphs:
    """Piecewise graphs of `plan` for token counts up to max(buckets); `run(feeds, meta)` pads the
    step's token inputs into the static buffers and replays its bucket (see the module docstring).
    `capture` defaults to CUDA graphs in one new pool (cuda_capture); eager_capture runs anywhere."""

    def __init__(
        self,
        plan: Plan,
        kv_cache: KVCache,
        buckets: Sequence[int],
        scratch_block: int,
        max_context_len: int,
        capture: Capture | None = None,
        mrope: bool = False,
        vision: tuple[int, torch.dtype] | None = None,
        *,
        lazy: bool = False,
    ) -> None:
        """lazy: capture no bucket now; each is captured at its first step (or by capture())."""
        reason = unfit_reason(plan)
        if reason is not None:
            raise ValueError(f"this plan cannot run as piecewise CUDA graphs: {reason}")
        if not buckets or min(buckets) < 1:
            raise ValueError(f"token buckets must be positive counts, got {list(buckets)}")
        self.plan, self.kv_cache, self.pieces = plan, kv_cache, plan.pieces()
        self.buckets = tuple(sorted(set(buckets)))
        self.scratch_block, self.max_context_len = scratch_block, max_context_len
        self.device = kv_cache.k[0].device
        # the token-indexed graph inputs (static buffers the step's rows are copied into) and what a padding row holds
        self.padding = {"input_ids": 0, "positions": 0, "slot_mapping": scratch_block * kv_cache.spec.block_size}
        size = self.buckets[-1]
        self.inputs = {
            **{
                name: torch.full((size,), pad, dtype=torch.int64, device=self.device)
                for name, pad in self.padding.items()
            },
            **qwen3_vl_inputs(size, self.device, mrope, vision),
        }
        self._last_reader = {name: i for i, node in enumerate(plan.nodes) for name in node.inputs}
        self._buffers: list[tuple[torch.Tensor, int]] = []  # (buffer, node index of its holder's last reader)
        self._buffer_of: dict[str, torch.Tensor] = {}
        self._capture_with = capture if capture is not None else cuda_capture(torch.cuda.graph_pool_handle())
        self.stages: dict[int, tuple[Callable[[], None] | EagerPiece, ...]] = {}
        for bucket in () if lazy else reversed(self.buckets):  # largest first: the smaller ones reuse its memory
            self.capture(bucket)

    @property
    def pending(self) -> tuple[int, ...]:
        """The buckets not captured yet (a lazy instance's), smallest first."""
        return tuple(b for b in self.buckets if b not in self.stages)

    @torch.inference_mode()
    def capture(self, bucket: int) -> None:
        """Capture `bucket`'s pieces (again if it has them); the token inputs are reset to padding first."""
        self.stages[bucket] = self._capture(bucket, self._capture_with)

    def bucket_for(self, tokens: int) -> int | None:
        return smallest_bucket(self.buckets, tokens)

    def fits(self, tokens: int) -> bool:
        return 0 < tokens <= self.buckets[-1]

    def _capture_step(self, bucket: int) -> tuple[StepContext, dict[str, torch.Tensor]]:
        """A step of `bucket` one-token sequences at position 0 of the scratch block: what the eager
        ops run on while the pieces are captured (the padded token inputs point there too)."""
        device, scratch = self.device, self.scratch_block
        slots = torch.tensor([self.padding["slot_mapping"]], dtype=torch.int64, device=device)
        meta = AttentionMetadata(
            tuple(range(bucket + 1)),
            (1,) * bucket,
            (slots,) * bucket,
            max_q_len=1,
            max_context_len=self.max_context_len,
        )
        feeds = {
            "block_tables": torch.full((bucket, 1), scratch, dtype=torch.int32, device=device),
            "context_lens": torch.ones(bucket, dtype=torch.int32, device=device),
            "query_start_loc": torch.arange(bucket + 1, dtype=torch.int32, device=device),
            "logits_indices": torch.arange(bucket, device=device),
        }
        return StepContext(self.kv_cache, meta), feeds

    def _capture(self, bucket: int, capture: Capture) -> tuple[Callable[[], None] | EagerPiece, ...]:
        plan, weights = self.plan, self.plan.weights
        step, sequence_feeds = self._capture_step(bucket)
        for name, pad in self.padding.items():
            self.inputs[name].fill_(pad)
        static = {**weights, **sequence_feeds}
        static.update((name, buf[..., :bucket] if name in self.padding else buf) for name, buf in self.inputs.items())
        last_piece = {name: i for i, piece in enumerate(self.pieces) for name in piece.reads}
        eager_reads = {name for piece in self.pieces if piece.eager for name in piece.reads}
        stages: list[Callable[[], None] | EagerPiece] = []
        for i, piece in enumerate(self.pieces):
            inputs = {name: static[name] for name in piece.reads}
            if piece.eager:
                stages.append(self._eager(piece, inputs, step, bucket))
                static.update(stages[-1].into)
            else:
                held = tuple(name for name in piece.writes if name in eager_reads)

                def run_piece(piece: Piece = piece, inputs: dict = inputs, held: tuple = held) -> Outputs:
                    env = {**inputs, "": None}
                    plan.run_nodes(step, env, piece.start, piece.stop)
                    # what eager code reads at replay, copied (inside the graph) into the shared buffers;
                    # a value without a row per token (an op's ordering token, empty) stays where it is
                    rows = [name for name in held if env[name].dim() and env[name].shape[0] == bucket]
                    env.update((name, self._buffer(name, env[name], piece, bucket)) for name in rows)
                    return {name: env[name] for name in piece.writes}

                outputs, replay = capture(run_piece)
                static.update(outputs)
                stages.append(replay)
            for name in [n for n, last in last_piece.items() if last == i and n in static and n not in weights]:
                del static[name]  # no later piece reads it: a captured output's memory goes back to the pool
        return tuple(stages)

    def _eager(self, piece: Piece, inputs: dict, step: StepContext, bucket: int) -> EagerPiece:
        """Run an eager piece on the capture step (its outputs feed the next captures) and record what
        it reads and writes at replay. The tail, whose outputs no piece reads, is not run."""
        weights = {name: t for name, t in inputs.items() if name in self.plan.weights}
        sequences = tuple(name for name in inputs if name in SEQUENCE_INPUTS)
        rows = {name: t for name, t in inputs.items() if name not in weights and name not in sequences}
        into = {}
        needed = [name for name in piece.writes if name != self.plan.output]
        if needed:
            env = {**inputs, "": None}
            self.plan.run_nodes(step, env, piece.start, piece.stop)
            into = {name: self._buffer(name, env[name], piece, bucket) for name in needed}
        return EagerPiece(piece, rows, weights, sequences, into)

    def _buffer(self, name: str, value: torch.Tensor, piece: Piece, bucket: int) -> torch.Tensor:
        """The static buffer `name` is copied into, [bucket, ...], holding `value`. Its buffer is one of
        max(buckets) rows, shared by every bucket and with every value of the same shape whose readers
        all come before `piece` (the assignment is made once, at the first bucket captured, and
        outside a capture: a capture's warm-up runs come first)."""
        if value.dim() == 0 or value.shape[0] != bucket:
            raise ValueError(
                f"{name!r}, a value that eager code and captured nodes pass between them, has no row per token"
            )
        if name not in self._buffer_of:
            shape, dtype = value.shape[1:], value.dtype
            free = [
                i
                for i, (b, until) in enumerate(self._buffers)
                if (b.shape[1:], b.dtype) == (shape, dtype) and until < piece.start
            ]
            if free:
                index, buf = free[0], self._buffers[free[0]][0]
            else:
                index, buf = len(self._buffers), torch.zeros(self.buckets[-1], *shape, dtype=dtype, device=value.device)
                self._buffers.append((buf, -1))
            self._buffers[index] = (buf, self._last_reader[name])
            self._buffer_of[name] = buf
        out = self._buffer_of[name][:bucket]
        out.copy_(value)
        return out

    def run(self, feeds: Mapping[str, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Logits of a step (ModelRunner.prepare's feeds and metadata) of at most max(buckets) tokens."""
        tokens = int(feeds["input_ids"].shape[0])
        bucket = self.bucket_for(tokens)
        if bucket is None or tokens < 1:
            raise ValueError(f"a step of {tokens} tokens fits no bucket of {list(self.buckets)}")
        if bucket not in self.stages:  # before the step's rows are written: the capture resets them
            self.capture(bucket)
        for name, pad in self.padding.items():
            buf = self.inputs[name]
            buf[..., :tokens].copy_(feeds[name])
            buf[..., tokens:bucket].fill_(pad)
        step, env = StepContext(self.kv_cache, meta), {}
        for stage in self.stages[bucket]:
            if not isinstance(stage, EagerPiece):
                stage()
                continue
            env = {**stage.weights, **{name: feeds[name] for name in stage.sequences}, "": None}
            env.update((name, t[:tokens]) for name, t in stage.rows.items())
            self.plan.run_nodes(step, env, stage.piece.start, stage.piece.stop)
            for name, buf in stage.into.items():
                buf[:tokens].copy_(env[name])
        return env[self.plan.output]
