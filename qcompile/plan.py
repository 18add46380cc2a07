"""Plan: which artifact tensors each WeightJob writes, into which shard file, and proof of coverage.

The plan is a strict bijection check in the style of mlc-llm's converter: every tensor of the
checkpoint is consumed by some job (or explicitly unused, like a tied lm_head), no job reads a
tensor the checkpoint lacks, and no artifact tensor is written twice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from qcompile.checkpoint import Checkpoint
from qcompile.errors import PlanError
from qcompile.io.safetensors_stream import OutputTensor
from qcompile.jobs import WeightJob

WEIGHTS_DIR = "weights"


@dataclass(frozen=True)
class Shard:
    """One output safetensors file (path relative to the artifact) and the tensors it holds."""

    file: str
    tensors: tuple[OutputTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class TensorPlan:
    jobs: tuple[WeightJob, ...]
    shards: tuple[Shard, ...]
    source_shapes: Mapping[str, tuple[int, ...]]
    model_dtype: torch.dtype

    def file_of(self) -> dict[str, str]:
        """Artifact tensor name -> relative file."""
        return {t.name: shard.file for shard in self.shards for t in shard.tensors}

    @property
    def source_bytes(self) -> int:
        """Bytes read from the checkpoint (a source used by two jobs counts twice)."""
        itemsize = self.model_dtype.itemsize
        return sum(math.prod(self.source_shapes[n]) * itemsize for job in self.jobs for n in job.source_names())

    @property
    def output_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)


def make_plan(checkpoint: Checkpoint, weights: Mapping[str, WeightJob], max_shard_bytes: int) -> TensorPlan:
    """Check coverage and lay the jobs' outputs out over shard files of at most `max_shard_bytes`
    (a job's weight and scale always share a file; a single larger job gets a file of its own)."""
    shapes = {name: entry.shape for name, entry in checkpoint.tensors.items()}
    model_dtype = getattr(torch, checkpoint.spec.dtype)
    jobs = tuple(weights.values())
    used: set[str] = set()
    for job in jobs:
        for name in job.source_names():
            if name not in shapes:
                raise PlanError(f"weight {job.weight_name!r} needs source tensor {name!r}, which the checkpoint lacks")
            used.add(name)
    leftover = sorted(set(shapes) - used - set(checkpoint.unused))
    if leftover:
        raise PlanError(
            f"source tensor {leftover[0]!r} is not used by the compiled graph "
            f"({len(leftover)} unused in all); the graph builder must cover every tensor"
        )

    groups: list[list[OutputTensor]] = [[]]
    sizes = [0]
    seen: set[str] = set()
    for job in jobs:
        try:
            outputs = job.outputs(shapes, model_dtype)
        except ValueError as exc:
            raise PlanError(str(exc)) from exc
        for out in outputs:
            if out.name in seen:
                raise PlanError(f"artifact tensor {out.name!r} would be written twice")
            seen.add(out.name)
        size = sum(o.nbytes for o in outputs)
        if groups[-1] and sizes[-1] + size > max_shard_bytes:
            groups.append([])
            sizes.append(0)
        groups[-1].extend(outputs)
        sizes[-1] += size
    count = len(groups)
    shards = tuple(
        Shard(f"{WEIGHTS_DIR}/model-{i + 1:05d}-of-{count:05d}.safetensors", tuple(group))
        for i, group in enumerate(groups)
    )
    return TensorPlan(jobs, shards, shapes, model_dtype)
