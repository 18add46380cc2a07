"""The fused MoE's last step: each token's k weighted expert outputs added (step 5).

out[t] = D(sum over slots s = 0 .. k-1, in that order, of out_pairs[t*k + s]) with an fp32
accumulator, D the model dtype. The reference op adds the contributions in D, in expert order, so
the two agree to within the rounding of those adds (the kernel's sum is the more accurate one).
The order is fixed, so the result is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qruntime.kernels.dynamic_quant import round_to, use_hw_casts
from qruntime.kernels.pdl import launch_options, wait_for_inputs

COLS = 1024  # columns per program


@triton.jit
def _moe_combine_kernel(
    pairs_ptr,  # [T*k, H] model dtype, contiguous
    out_ptr,  # [T, H] model dtype, contiguous
    H,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    wait_for_inputs(PDL)
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(TOP_K):  # slot order
        acc += tl.load(pairs_ptr + (token * TOP_K + s) * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * H + cols, round_to(acc, DTYPE, HW).to(DTYPE), mask=mask)


@dataclass(frozen=True)
class PairRows:
    """The fused MoE's output before its combine launch: out_pairs [T*k, H] (model dtype), each
    token's k weighted expert rows. add_rmsnorm[_quant] takes it in place of the [T, H] output and
    adds each token's rows as moe_combine does (deferred_sum.deferred_value), saving the launch;
    `reduce()` runs moe_combine for any other reader."""

    out_pairs: torch.Tensor
    top_k: int
    pdl: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_pairs.shape[0] // self.top_k, self.out_pairs.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.out_pairs.dtype

    @property
    def device(self) -> torch.device:
        return self.out_pairs.device

    @property
    def slices(self) -> int:
        return self.top_k

    scaled = False

    def sum_args(self) -> tuple:
        """(base, xs, ws, slice stride, row stride, stride of xs, stride of ws): deferred_value's
        (no scales: xs and ws stand in for them, never read)."""
        hidden = self.out_pairs.shape[1]
        return (self.out_pairs, self.out_pairs, self.out_pairs, hidden, self.top_k * hidden, 0, 0)

    def reduce(self) -> torch.Tensor:
        return moe_combine(self.out_pairs, self.top_k, pdl=self.pdl)


def moe_combine(out_pairs: torch.Tensor, top_k: int, *, pdl: bool = False) -> torch.Tensor:
    """[T*k, H] -> [T, H]: each token's k rows added in slot order in fp32, cast to their dtype."""
    pairs, hidden = out_pairs.shape
    if pairs % top_k or not out_pairs.is_contiguous():
        raise ValueError(f"out_pairs must be contiguous [T*k, H] with k = {top_k}, got {tuple(out_pairs.shape)}")
    if top_k == 1:
        return out_pairs  # one slot: the sum is the row itself
    tokens = pairs // top_k
    out = torch.empty(tokens, hidden, dtype=out_pairs.dtype, device=out_pairs.device)
    if tokens:
        block = min(COLS, triton.next_power_of_2(hidden))
        _moe_combine_kernel[(tokens, triton.cdiv(hidden, block))](
            out_pairs,
            out,
            hidden,
            TOP_K=top_k,
            BLOCK=block,
            HW=use_hw_casts(out_pairs),
            num_warps=4,
            **launch_options(pdl),
        )
    return out
