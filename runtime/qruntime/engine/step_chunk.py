"""StepChunk: what one sequence computes in one step, as plain data. The model runner and the CUDA
graphs take it, the engine makes it from the scheduler's chunks, and a tensor-parallel rank 0 pickles
it to the other ranks (hence its small `__reduce__`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qruntime.engine.multimodal import RequestImages
    from qruntime.engine.scheduler import ScheduledChunk


@dataclass(frozen=True, slots=True)
class StepChunk:
    """The tokens one sequence computes in one step: positions start .. start + len(token_ids) - 1,
    whose KV goes to the blocks of block_table (which covers every position up to the last)."""

    token_ids: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]
    # Qwen3-VL (engine/multimodal.py), for a request with images: its tokens' M-RoPE positions (three
    # rows: temporal, height, width; None: each token's position on all three), the chunk's rows that
    # hold image tokens, and those rows' vision embeddings [rows, (1 + D) * H] on the device
    mrope: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None
    vision_rows: tuple[int, ...] = ()
    vision_embeds: Any = None  # torch.Tensor | None (no torch import here: the scheduler's side is plain)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def __reduce__(self) -> tuple:
        if self.mrope is None and self.vision_embeds is None:
            return StepChunk, (self.token_ids, self.start, self.block_table)  # 2x faster than the dataclass default
        args = (self.token_ids, self.start, self.block_table, self.mrope, self.vision_rows, self.vision_embeds)
        return StepChunk, args

    @classmethod
    def of(
        cls, chunk: ScheduledChunk, pending_row: int | None = None, images: RequestImages | None = None
    ) -> StepChunk:
        """The step data of a scheduled chunk: its request's token ids of this step (sliced from the
        prompt and the outputs, not from their concatenation: a decode step costs O(1), not O(context)).

        A chunk that ends on its request's pending token (sampled by the step before, still on the
        device) gets `pending(pending_row)` in its place: that step's sampled row `pending_row`. A chunk
        with drafts (speculative decoding) ends on them."""
        request, start, end = chunk.request, chunk.start, chunk.start + chunk.num_tokens - len(chunk.draft)
        n = len(request.prompt_token_ids)
        ids = request.prompt_token_ids[start:end] + request.output_token_ids[max(start - n, 0) : max(end - n, 0)]
        missing = chunk.num_tokens - len(chunk.draft) - len(ids)
        if missing:
            if missing != 1 or pending_row is None:
                raise ValueError(
                    f"request {request.request_id!r}: {missing} token(s) of its chunk are pending, "
                    f"{'with no sampled row to read' if pending_row is None else 'only its last one may be'}"
                )
            ids.append(pending(pending_row))
        if images is None:
            return cls((*ids, *chunk.draft), start, chunk.block_table)
        if chunk.draft:
            raise ValueError(f"request {request.request_id!r}: a request with images does not draft tokens")
        mrope, rows, embeds = images.chunk_parts(start, start + chunk.num_tokens)
        return cls(tuple(ids), start, chunk.block_table, mrope, rows, embeds)


def pending(row: int) -> int:
    """The token id standing for row `row` of the previous step's sampled tokens (negative: no real
    id is); the model runner reads it on the device (resolve_pending)."""
    return -1 - row
