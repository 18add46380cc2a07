"""How a load reads its device, dtype and backend arguments: the loader's decisions, also made by
qruntime.early_prebuild before the loader is imported (this module imports torch only)."""

from __future__ import annotations

import torch

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(dtype: torch.dtype | str | None, manifest: dict) -> torch.dtype:
    """The compute dtype: as asked, else the model's (the manifest's spec.dtype, bf16 by default)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or manifest["spec"].get("dtype", "bfloat16")
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """cuda when available by default; a device this machine does not have is a ValueError."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a torch device (cpu, cuda, cuda:1 ...)") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA device is available (torch {torch.__version__})")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: the runtime runs on cpu or cuda")
    return resolved


TRITON_DTYPES = (torch.bfloat16, torch.float16)  # what the Triton kernels compute in


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """ "auto" -> "triton" on CUDA in bf16/fp16, else "reference"; an explicit choice is checked."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and dtype in TRITON_DTYPES else "reference"
    if backend not in ("reference", "triton"):
        raise ValueError(f"backend {backend!r} is not one of 'auto', 'reference', 'triton'")
    if backend == "triton" and device.type != "cuda":
        raise ValueError("backend 'triton' runs on a CUDA device")
    if backend == "triton" and dtype not in TRITON_DTYPES:
        raise ValueError(f"backend 'triton' computes in bf16 or fp16, not {dtype}; use backend 'reference' for it")
    return backend
