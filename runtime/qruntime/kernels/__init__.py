"""Triton kernels of the GPU fast path, one per file, each checked against its torch reference in
qruntime.ops.functional (CI runs them under TRITON_INTERPRET=1 at small shapes). Importing a kernel
module imports triton; the reference path never does (this package's own module does not)."""

from __future__ import annotations

import os

import torch


def kernel_runs_on(device: torch.device) -> bool:
    """Whether the kernels can run on tensors of `device`: a GPU, or any device under Triton's
    interpreter (how CI runs them on CPU tensors)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched with programmatic dependent launch (kernels/pdl.py):
    an NVIDIA GPU of compute capability 9.0 or later (Hopper), compiled for it (not the interpreter)."""
    if device.type != "cuda" or torch.version.hip is not None or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9
