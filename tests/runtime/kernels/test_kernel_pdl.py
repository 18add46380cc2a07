"""Programmatic dependent launch (kernels/pdl.py), compiled for an H100 without a GPU: with PDL each
kernel of a decode layer waits for the previous kernel before it reads or writes anything (the
GEMM may only ask L2 for its constant weights first), then lets the next one launch; without PDL
none of it is compiled in. The interpreter cannot run the wait; the GPU tier checks that PDL
launches give the same bits as plain ones (tests/gpu/test_pdl.py)."""

from __future__ import annotations

import re

import pytest
import torch
from hopper_ptx import hopper_ptx
from qruntime.kernels import pdl_supported
from qruntime.loader import resolve_pdl

WAIT, RELEASE = re.compile(r"griddepcontrol\.wait\s*;"), re.compile(r"griddepcontrol\.launch_dependents\s*;")
# a global load, store or atomic (kernel parameters are read with ld.param, not global memory)
MEMORY = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:(?:ld|st|atom|red)\.global|cp\.async)", re.MULTILINE)

NORM = (
    "qruntime.kernels.add_rmsnorm_quant",
    "_add_rmsnorm_kernel",
    {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "ro_ptr": "*bf16", "y_ptr": "*u8", "s_ptr": "*fp32"}
    | {"xs_ptr": "*fp32", "ws_ptr": "*bf16", "slice_stride": "i32", "row_stride": "i32", "stride_xs": "i32"}
    | {"stride_ws": "i32", "H": "i32", "stride_x": "i32", "stride_r": "i32", "eps": "fp32"},
    {"HAS_RES": True, "QUANT": True, "BLOCK": 4096, "NUM_CHUNKS": 1, "HW": True, "SPLIT": 0, "SCALED": True},
    8,
)
GEMM = (
    "qruntime.kernels.fp8_gemm",
    "_ptpc_fp8_gemm_kernel",
    {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*bf16", "c_ptr": "*bf16"}
    | {"part_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_as": "i32"}
    | {"stride_bn": "i32", "stride_bs": "i32", "stride_cm": "i32", "K_PER_SPLIT": "i32"},
    {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 2, "GROUP_M": 8, "EVEN_K": True, "ACC_PROMOTE_K": 128},
    4,
)
REDUCE = (
    "qruntime.kernels.fp8_gemm",
    "_splitk_reduce_kernel",
    {"part_ptr": "*fp32", "as_ptr": "*fp32", "bs_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32"}
    | {"stride_as": "i32", "stride_bs": "i32"},
    {"SPLIT_K": 2, "BLOCK": 1024, "HW": True},
    4,
)
SILU = (
    "qruntime.kernels.silu_mul_quant",
    "_silu_mul_quant_kernel",
    {"gu_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "xs_ptr": "*fp32", "ws_ptr": "*bf16", "T": "i32"}
    | {"stride_xs": "i32", "stride_ws": "i32", "inter": "i32", "stride_gu": "i32"},
    {"BLOCK": 4096, "NUM_CHUNKS": 3, "HW": True, "SPLIT": 0, "DTYPE": "tl.bfloat16"},
    8,
)
SILU_PLAIN = (
    "qruntime.kernels.silu_mul_quant",
    "_silu_mul_kernel",
    {"gu_ptr": "*bf16", "y_ptr": "*bf16", "inter": "i32", "stride_gu": "i32"},
    {"BLOCK": 4096, "NUM_CHUNKS": 3, "HW": True, "DTYPE": "tl.bfloat16"},
    8,
)
QUANT = (
    "qruntime.kernels.dynamic_quant",
    "_dynamic_quant_kernel",
    {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "K": "i32", "stride_x": "i32"},
    {"BLOCK": 4096, "NUM_CHUNKS": 1, "HW": True},
    8,
)


def _ptx(kernel: tuple, **constexprs) -> str:
    module, name, types, fixed, warps = kernel
    return hopper_ptx(module, name, types, fixed | constexprs, warps)


def _split(kernel: tuple) -> tuple:
    """The kernel reading a split-K GEMM's partials (fp32) in place of its input."""
    module, name, types, fixed, warps = kernel
    first = next(iter(types))
    return module, name, types | {first: "*fp32"}, fixed | {"SPLIT": 2}, warps


@pytest.mark.parametrize(
    "kernel",
    [NORM, _split(NORM), REDUCE, SILU, _split(SILU), SILU_PLAIN, QUANT],
    ids=["norm", "norm-partials", "reduce", "silu", "silu-partials", "silu-plain", "quant"],
)
def test_with_pdl_a_kernel_waits_before_touching_memory_then_releases_the_next(kernel):
    ptx = _ptx(kernel, PDL=True)
    assert len(WAIT.findall(ptx)) == 1 and len(RELEASE.findall(ptx)) == 1, "one wait, one release"
    wait = WAIT.search(ptx).start()
    assert wait < RELEASE.search(ptx).start(), "the next kernel is released only once this one may read"
    first_access = MEMORY.search(ptx)
    assert first_access is not None and first_access.start() > wait, f"memory touched before the wait: {first_access}"
    plain = _ptx(kernel, PDL=False)
    assert "griddepcontrol" not in plain


@pytest.mark.parametrize("prefetch_k", [0, 1024])
def test_the_gemm_only_prefetches_its_weights_before_the_wait(prefetch_k):
    ptx = _ptx(GEMM, PDL=True, PREFETCH_K=prefetch_k)
    assert len(WAIT.findall(ptx)) == 1 and len(RELEASE.findall(ptx)) == 1
    wait = WAIT.search(ptx).start()
    first_access = MEMORY.search(ptx)
    assert first_access is not None and first_access.start() > wait, f"memory touched before the wait: {first_access}"
    before = ptx[:wait]
    # 8 L2 lines of each of the program's 32 weight rows, 256 prefetches over 128 threads
    assert before.count("prefetch.global.L2") == (2 if prefetch_k else 0)
    assert "prefetch.global.L2" not in ptx[wait:]
    plain = _ptx(GEMM, PDL=False, PREFETCH_K=prefetch_k)
    assert "griddepcontrol" not in plain and "prefetch.global.L2" not in plain


def test_pdl_is_only_asked_of_a_hopper_gpu():
    cpu = torch.device("cpu")
    assert not pdl_supported(cpu)
    assert resolve_pdl(None, cpu, "reference") is False
    assert resolve_pdl(False, cpu, "reference") is False
    with pytest.raises(ValueError, match=r"pdl=True needs the triton backend .*compute capability 9\.0"):
        resolve_pdl(True, cpu, "reference")
