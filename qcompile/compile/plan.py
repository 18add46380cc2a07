"""Plan: which artifact tensors each WeightJob writes, into which shard file, and proof of coverage.

The plan is a strict bijection check in the style of mlc-llm's converter: every tensor of the
checkpoint is consumed by some job (or explicitly unused, like a tied lm_head), no job reads a
tensor the checkpoint lacks, and no artifact tensor is written twice.

At tp > 1 every rank gets its own files, `weights/rank{r}/model-…`, laid out alike: the same tensor
names, each rank's slice of every tensor (qcompile.compile.sharding), the same grouping into files.
A Qwen3-VL checkpoint's vision tower is the exception: rank 0 alone runs the encoder (docs/vision.md,
"Tensor parallelism"), so its tensors are written once, whole, into rank 0's `vision-…` files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from qcompile.compile.jobs import WeightJob
from qcompile.compile.sharding import Sharding, Split
from qcompile.errors import PlanError
from qcompile.io.safetensors_stream import OutputTensor
from qcompile.source.checkpoint import Checkpoint

WEIGHTS_DIR = "weights"


@dataclass(frozen=True)
class Shard:
    """One output safetensors file (path relative to the artifact), the tensors it holds, and the
    tensor-parallel rank it belongs to (0 at tp=1)."""

    file: str
    tensors: tuple[OutputTensor, ...]
    rank: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class TensorPlan:
    jobs: tuple[WeightJob, ...]
    shards: tuple[Shard, ...]
    source_shapes: Mapping[str, tuple[int, ...]]
    model_dtype: torch.dtype
    tp: int = 1
    splits: Mapping[str, Split] = field(default_factory=dict)  # tensor -> how the ranks slice it (tp > 1)
    # pre-quantized sources (copied, not quantized): bytes of their stored weights, read instead
    stored_bytes: Mapping[str, int] = field(default_factory=dict)
    rank0_only: frozenset[str] = frozenset()  # tp > 1: tensors rank 0 alone holds, whole (the vision tower's)

    def holders(self, name: str) -> range:
        """The ranks that hold a copy (or a slice) of tensor `name`."""
        return range(1) if name in self.rank0_only else range(self.tp)

    def file_of(self, rank: int = 0) -> dict[str, str]:
        """Artifact tensor name -> relative file (of rank `rank`'s copy)."""
        return {t.name: shard.file for shard in self.shards if shard.rank == rank for t in shard.tensors}

    @property
    def source_bytes(self) -> int:
        """Bytes read from the checkpoint (a source used by two jobs counts twice; a stored quantized
        weight counts its stored bytes, not its scales)."""
        itemsize = self.model_dtype.itemsize
        return sum(
            self.stored_bytes.get(n, math.prod(self.source_shapes[n]) * itemsize)
            for job in self.jobs
            for n in job.source_names()
        )

    @property
    def output_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)


def make_plan(
    checkpoint: Checkpoint, weights: Mapping[str, WeightJob], max_shard_bytes: int, tp: int = 1
) -> TensorPlan:
    """Check coverage and lay the jobs' outputs out over shard files of at most `max_shard_bytes`
    (a job's weight and scale always share a file; a single larger job gets a file of its own);
    at tp > 1, each rank's slices over files of its own. A linear the checkpoint stores quantized
    (pre-quantized input) must be read by a job of its own scheme: its tensors are copied as they are."""
    # the text graph's sources and a Qwen3-VL checkpoint's tower tensors, which its vision graph reads
    shapes = {**checkpoint.source_shapes(), **{name: e.shape for name, e in checkpoint.tower_tensors().items()}}
    model_dtype = getattr(torch, checkpoint.spec.dtype)
    jobs = tuple(weights.values())
    used: set[str] = set()
    for job in jobs:
        for name in job.source_names():
            if name not in shapes:
                raise PlanError(f"weight {job.weight_name!r} needs source tensor {name!r}, which the checkpoint lacks")
            stored = checkpoint.stored.get(name)
            if stored is not None and stored.format.scheme != job.scheme:
                raise PlanError(
                    f"weight {job.weight_name!r} is to be {job.scheme!r}, but the checkpoint stores its source "
                    f"{stored.weight.name!r} as {stored.format.scheme!r} ({stored.format.describe()}); a stored "
                    "quantized weight is copied, never dequantized or re-quantized"
                )
            if stored is None and job.quant.zero_point and len(shapes[name]) == 2:
                raise PlanError(
                    f"weight {job.weight_name!r} is to be {job.scheme!r}, but its source {name!r} is not stored "
                    f"quantized: scheme {job.scheme!r} (int4 with zero points) is read from pre-quantized "
                    "checkpoints only; quantize the unquantized checkpoint with recipe w4a16 instead"
                )
            used.add(name)
    leftover = sorted(set(shapes) - used - set(checkpoint.unused))
    if leftover:
        raise PlanError(
            f"source tensor {leftover[0]!r} is not used by the compiled graph "
            f"({len(leftover)} unused in all); the graph builder must cover every tensor"
        )

    sharding = Sharding(checkpoint.spec, tp)
    splits: dict[str, Split] = {}
    text, tower = _Groups(max_shard_bytes), _Groups(max_shard_bytes)
    rank0_only: set[str] = set()
    seen: set[str] = set()
    for job in jobs:
        try:
            outputs = job.outputs(shapes, model_dtype)
        except ValueError as exc:
            raise PlanError(str(exc)) from exc
        alone = tp > 1 and job.role == "vision"  # rank 0 alone runs the vision encoder: one whole copy
        if alone:
            rank0_only.update(o.name for o in outputs)
        elif tp > 1:
            splits.update(sharding.splits(job, shapes))
            outputs = [OutputTensor(o.name, o.dtype, splits[o.name].shape(o.shape)) for o in outputs]
        for out in outputs:
            if out.name in seen:
                raise PlanError(f"artifact tensor {out.name!r} would be written twice")
            seen.add(out.name)
        (tower if alone else text).add(outputs)
    count = len(text.groups)
    shards = tuple(
        Shard(f"{rank_dir(rank, tp)}/model-{i + 1:05d}-of-{count:05d}.safetensors", tuple(group), rank)
        for rank in range(tp)
        for i, group in enumerate(text.groups)
    )
    if tower.groups[0]:
        count = len(tower.groups)
        shards += tuple(
            Shard(f"{rank_dir(0, tp)}/vision-{i + 1:05d}-of-{count:05d}.safetensors", tuple(group), 0)
            for i, group in enumerate(tower.groups)
        )
    stored_bytes = {name: s.weight.nbytes for name, s in checkpoint.stored.items()}
    return TensorPlan(jobs, shards, shapes, model_dtype, tp, splits, stored_bytes, frozenset(rank0_only))


class _Groups:
    """Output tensors gathered into files of at most `limit` bytes (a job's tensors stay together;
    a single larger job gets a file of its own)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.groups: list[list[OutputTensor]] = [[]]
        self.sizes = [0]

    def add(self, outputs: list[OutputTensor]) -> None:
        size = sum(o.nbytes for o in outputs)
        if self.groups[-1] and self.sizes[-1] + size > self.limit:
            self.groups.append([])
            self.sizes.append(0)
        self.groups[-1].extend(outputs)
        self.sizes[-1] += size


def rank_dir(rank: int, tp: int) -> str:
    """The folder of rank `rank`'s weight files: `weights` at tp=1, `weights/rank{r}` at tp > 1."""
    return WEIGHTS_DIR if tp == 1 else f"{WEIGHTS_DIR}/rank{rank}"
