"""A Qwen3-VL step's image embeddings at tp > 1: rank 0 runs the vision encoder (it alone holds the
tower's weights), and every rank needs the embeddings and DeepStack features of the step's image rows
(the hidden state is replicated: each rank writes them over its token embeddings and adds the
features after the first D layers). Rank 0 sends them in one torch.distributed broadcast over the
ranks' group (NCCL between GPUs, gloo on CPU), not through the workers' pipes: the step message
carries the chunks without their embeddings and the number of image rows, and a worker whose step
holds image rows enters the same broadcast before it runs the step. A 1024 x 1024 image is 1024
rows of (1 + 3) x 4096 bf16 values at 8B, 32 MiB: pickled through a pipe it would be copied to
the host and back on every worker, where the broadcast moves it device to device.

Every rank meets the broadcast at the same place in its sequence of collectives (before the step's
own), so async scheduling (rank 0 launching the next step before it reads this one's tokens) keeps
the ranks paired."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from qruntime.engine.step_chunk import StepChunk


def without_embeds(chunks: Sequence[StepChunk]) -> tuple[tuple[StepChunk, ...], int]:
    """The chunks as the workers get them, their vision embeddings left out (their rows and M-RoPE
    positions kept), and the step's number of image rows (0: no broadcast)."""
    rows = sum(len(c.vision_rows) for c in chunks)
    if not rows:
        return tuple(chunks), 0
    return tuple(dataclasses.replace(c, vision_embeds=None) if c.vision_rows else c for c in chunks), rows


def send_embeds(chunks: Sequence[StepChunk], rows: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
    """Rank 0: broadcast the step's image rows' embeddings [rows, width] (in step order, the compute
    dtype, on rank 0's device) to the group."""
    embeds = torch.cat([c.vision_embeds for c in chunks if c.vision_rows]).to(device, dtype)
    if embeds.shape != (rows, width):
        raise ValueError(f"the step's vision embeddings are {tuple(embeds.shape)}, not [{rows}, {width}]")
    dist.broadcast(embeds.contiguous(), src=0)


def receive_embeds(
    chunks: Sequence[StepChunk], rows: int, width: int, dtype: torch.dtype, device: torch.device
) -> list[StepChunk]:
    """A worker: the step's `rows` image rows' embeddings from rank 0's broadcast, given back to the
    chunks holding those rows (each its own rows, in step order)."""
    if sum(len(c.vision_rows) for c in chunks) != rows:
        raise ValueError(
            f"rank 0 announced {rows} image rows for chunks holding {sum(len(c.vision_rows) for c in chunks)}"
        )
    embeds = torch.empty((rows, width), dtype=dtype, device=device)
    dist.broadcast(embeds, src=0)
    out, start = [], 0
    for chunk in chunks:
        if chunk.vision_rows:
            count = len(chunk.vision_rows)
            chunk = dataclasses.replace(chunk, vision_embeds=embeds[start : start + count])
            start += count
        out.append(chunk)
    return out
