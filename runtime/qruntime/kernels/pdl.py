"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start while
the kernel before it on the stream is still running, so its launch, its programs' placement and
whatever it does not need from that kernel overlap that kernel's tail.

A decode step is a chain of a few hundred short kernels, each reading what the one before wrote;
without PDL each waits for the previous one to finish entirely before it is even launched
(~1-2 µs a kernel in a CUDA graph). With it, every kernel of the fast path starts with
`wait_for_inputs`: `griddepcontrol.wait` blocks until the previous kernel has completed and its
writes are visible (PTX ISA, "griddepcontrol"), then `griddepcontrol.launch_dependents` lets the
next kernel launch. Nothing but constant weights may be read before the wait, and nothing written:
the previous kernel may still be reading it. A kernel launched without PDL waits for its
predecessor as always, so PDL and non-PDL kernels (torch's, cuBLAS) mix freely; the order is
transitive because every PDL kernel waits for the one before it. Inside a CUDA graph the
dependency is captured as a programmatic edge.

Kernels take a constexpr `PDL` (False under Triton's interpreter and off Hopper: the wait compiles
to nothing then) and their wrappers a `pdl` flag passed as Triton's `launch_pdl`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel is done and its writes visible, then let the next
    kernel launch (its programs then wait here in turn). Without: nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask the L2 cache for the lines at `ptrs` (a hint: nothing is returned or waited for)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


def launch_options(pdl: bool) -> dict[str, bool]:
    """The constexpr and the launch flag of a kernel call with or without PDL."""
    return {"PDL": pdl, "launch_pdl": pdl}
