"""The collectives of a tensor-parallel artifact's rank graphs (docs/OPS.md): AllReduce, its fusion
with the residual add and RMSNorm that follow every row-parallel output, and AllGather (the
vocabulary-parallel lm_head's logits put together).

Each rank's o_proj / down_proj / MoE output is a partial sum over its share of the heads or of the
intermediate dim; these ops sum it over the ranks with `torch.distributed.all_reduce` on the group
the loader puts in `OpEnv.tp_group` (NCCL on GPUs, gloo on CPU), then run the reference norm ops.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from qruntime.ops import quant
from qruntime.ops.base import Op, OpBindError, OpEnv


def check_group(env: OpEnv) -> None:
    """OpBindError unless the engine runs as one rank of a tensor-parallel group."""
    if env.tp_group is None:
        raise OpBindError(
            "this graph is one rank of a tensor-parallel (sharded) artifact: it sums partial outputs over "
            "the ranks; load the artifact with tp=N, N its manifest's `tp`"
        )


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of `x` over the ranks of `group`, in a new tensor (x is left as it is)."""
    summed = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(summed, group=group)
    return summed


class AllReduce(Op):
    """y = the sum over the ranks of their x [T, H]."""

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        check_group(env)

    def __call__(self, step, x):
        return all_reduce(x, self.env.tp_group)


class AllReduceAddRMSNorm(quant.AddRMSNorm):
    """AddRMSNorm of the sum over the ranks of their x (the rank's partial sum)."""

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        check_group(env)

    def __call__(self, step, x, residual, w):
        return super().__call__(step, all_reduce(x, self.env.tp_group), residual, w)


class AllReduceAddRMSNormQuant(quant.AddRMSNormQuant):
    """AddRMSNormQuant of the sum over the ranks of their x (the rank's partial sum)."""

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        check_group(env)

    def __call__(self, step, x, residual, w):
        return super().__call__(step, all_reduce(x, self.env.tp_group), residual, w)


def all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """[world, *x.shape]: every rank's x (the same shape and dtype on each) stacked in rank order."""
    world = dist.get_world_size(group)
    stacked = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the name torch >= 2.13 keeps
    gather(stacked.view(world * x.shape[0], *x.shape[1:]), x.contiguous(), group=group)
    return stacked


def all_gather_columns(x: torch.Tensor, group) -> torch.Tensor:
    """[B, n] of every rank -> [B, tp * n], rank 0's columns first: one all-gather of the rows
    stacked by rank, then the ranks' blocks side by side (one copy)."""
    stacked = all_gather_rows(x, group)
    world, rows, cols = stacked.shape
    return stacked.permute(1, 0, 2).reshape(rows, world * cols)


class AllGather(Op):
    """y [B, tp * n] = the ranks' x [B, n] side by side along axis 1 (rank order)."""

    attrs = ("axis",)

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        check_group(env)
        if self.a["axis"] != 1:
            raise OpBindError(f"AllGather gathers along axis 1 (the logits' columns), not {self.a['axis']}")

    def __call__(self, step, x):
        return all_gather_columns(x, self.env.tp_group)
