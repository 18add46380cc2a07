"""Host values onto the device without waiting for the device.

A blocking copy from pageable host memory, which is what `torch.tensor(data, device="cuda")`,
`t.to("cuda")` and indexing a CUDA tensor with a Python list do, synchronizes the stream: the host
waits for every kernel queued before it. With async scheduling that is the whole step in flight, so
a step that made one such copy lost its overlap with the device. These copies go through pinned
memory and are asynchronous; torch's pinned-memory cache keeps each staging buffer until the copy
that reads it has run (it records an event on the stream), so the host may build the next one at once.

`pack` lays several host arrays into one buffer, each at a 16-byte-aligned offset, for a single
copy: Triton specializes a pointer argument on its 16-byte alignment, so a view at an unaligned
offset would make a kernel variant of its own, compiled mid-serving.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

ALIGN_BYTES = 16


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`: pinned and copied asynchronously to a CUDA device, as it is
    (no copy) on the CPU."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def host_buffer(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a CPU tensor a copy to `device` reads without a sync: pinned for a CUDA device (the
    pinned-memory cache keeps it until the copy has run), as it is for the CPU."""
    host = torch.from_numpy(array)
    return host.pin_memory() if device.type == "cuda" else host


def device_tensor(data: Sequence | float | int, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """torch.tensor(data, dtype=dtype, device=device) without a host sync (see the module docstring)."""
    return to_device(torch.tensor(data, dtype=dtype), device)


def pack(arrays: Mapping[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Arrays of one dtype on `device` in one copy: views of one buffer, each contiguous, of its
    array's shape, starting at a 16-byte-aligned offset."""
    dtypes = {a.dtype for a in arrays.values()}
    if len(dtypes) != 1:
        raise ValueError(f"pack takes arrays of one dtype, got {sorted(map(str, dtypes))}")
    itemsize = dtypes.pop().itemsize
    step = max(ALIGN_BYTES // itemsize, 1)
    offsets, end = {}, 0
    for name, array in arrays.items():
        offsets[name] = end
        end += -(-array.size // step) * step
    host = np.zeros(end, dtype=next(iter(arrays.values())).dtype)
    for name, array in arrays.items():
        host[offsets[name] : offsets[name] + array.size] = array.ravel()
    flat = to_device(torch.from_numpy(host), device)
    return {name: flat[offsets[name] : offsets[name] + a.size].view(a.shape) for name, a in arrays.items()}
