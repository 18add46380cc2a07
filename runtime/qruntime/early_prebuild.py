"""Start an artifact's kernel builds (qruntime.kernel_prebuild) at the load's call, right after torch.

A load starts building the artifact's recorded kernels once it has imported the loader (the engine,
onnx, the tokenizer: 0.3 s warm, more from a cold disk), read its manifest, tokenizer and graph,
and reached the rank's build: on an H200 a kernels-cold qwen3-8b then waited 1.7-2.3 s for its builds
after the weights were bound. `start_early` starts them as soon as torch is imported, from what the
call's own arguments and the manifest say (a local artifact of one rank, the Triton backend on an
NVIDIA GPU as the loader decides it, qruntime.load_options, kernels built ahead); the rank's build
adopts it when it was started for the same artifact and device and the load builds kernels ahead
(rank._start_prebuild), and cancels it otherwise; the caller cancels one that a failed load never took. Nothing here changes
what runs: the build reads the list the load would read (same artifact, same GPU), and the
kernels it puts in Triton's cache are only found there by the JIT.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qruntime.kernel_prebuild import Prebuild


@dataclass(frozen=True)
class EarlyPrebuild:
    """The build started for `root` on `device` (None: the artifact has no list for this GPU and
    Triton, which start_prebuild said once; the load does not look again)."""

    root: Path
    device: torch.device  # with its index
    build: Prebuild | None

    def serves(self, root: str | Path, device: torch.device) -> bool:
        """Whether a load of `root` on `device` reads the list this build was started from."""
        return Path(root) == self.root and _indexed(device) == self.device

    def cancel(self) -> None:
        """Stop the build (a no-op once the load waited for it)."""
        if self.build is not None:
            self.build.cancel()


def start_early(
    path: str | Path, args: tuple[Any, ...], kwargs: dict[str, Any], manifest: dict[str, Any] | None = None
) -> EarlyPrebuild | None:
    """The kernel build for `qruntime.loader.load(path, *args, **kwargs)`, started now; None where
    the load will not build kernels ahead: not a one-rank local artifact, or its device, dtype and
    backend (decided as the loader decides them, qruntime.load_options) not the Triton backend on
    an NVIDIA GPU, or prebuild_kernels off; also where the arguments or the artifact are wrong
    (the load reports them). `manifest`: the artifact's read_manifest, where the caller has it."""
    from qruntime.artifact import ArtifactFormatError, read_manifest
    from qruntime.kernel_prebuild import default_jobs, start_prebuild
    from qruntime.load_options import resolve_backend, resolve_device, resolve_dtype

    device = args[0] if args else kwargs.get("device")
    dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
    if str(path).startswith("hf://") or kwargs.get("prebuild_kernels", True) is not True:
        return None
    if kwargs.get("tp") not in (None, 1):
        return None
    try:
        if device is not None and torch.device(device).type != "cuda":
            return None  # decided before CUDA is touched (a CPU or a sharded load never initialises it here)
        manifest = manifest if manifest is not None else read_manifest(Path(path))
        if manifest.get("tp", 1) != 1:
            return None
        resolved = resolve_device(device)
        backend = resolve_backend(kwargs.get("backend", "auto"), resolved, resolve_dtype(dtype, manifest))
        if backend != "triton" or torch.version.hip is not None:
            return None
        resolved = _indexed(resolved)
        if resolved.index >= torch.cuda.device_count():
            return None
    except (ArtifactFormatError, OSError, ValueError, TypeError, RuntimeError, KeyError):
        return None  # the load says what is wrong
    name, capability = torch.cuda.get_device_name(resolved), torch.cuda.get_device_capability(resolved)
    build = start_prebuild(Path(path), frozenset(manifest["files"]), name, capability, default_jobs(), warm=False)
    return EarlyPrebuild(Path(path), resolved, build)


def _indexed(device: torch.device) -> torch.device:
    """A CUDA device with its index (the current device's when it has none)."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())
