"""Compile targets: the GPU family an artifact is made for (`qcompile compile --target`), recorded in
its manifest, checked by `load` against the device it is loaded on.

A target decides what the compiler writes so that nothing is converted at load:
- nvidia-sm90 (the default; Hopper, and the NVIDIA GPUs that run its kernels): FP8 weights as
  float8_e4m3fn (OCP E4M3, ±448), byte-identical to llm-compressor's; KV cache `nhd` by default;
- amd-gfx942 (MI300X / MI308X / MI325X): FP8 weights as float8_e4m3fnuz (±240, exponent bias 8,
  no negative zero: the bit pattern 0x80 is its only NaN). The same bits read as e4m3fnuz are half
  their e4m3fn value, so the compiler keeps the e4m3fn codes (0x80, e4m3fn's −0, becomes 0x00) and
  doubles their scales: every dequantized weight equals the e4m3fn artifact's exactly. vLLM's ROCm
  path does the same at every start (normalize_e4m3fn_to_e4m3fnuz); here it is done once. KV cache
  in AITER's x-packed layout by default.

A recipe's `kv_cache.layout: auto` (the shipped recipes') takes the target's layout.

An artifact without a target is an nvidia-sm90 one (artifacts from before targets existed). The
CLIs read TARGETS before any torch import (a mistyped path costs no torch import): torch is
imported by the functions that use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class TargetMismatch(ValueError):
    """An artifact loaded on a device of another target."""


@dataclass(frozen=True)
class Target:
    name: str
    vendor: str  # "nvidia" | "amd"
    arch: str  # the GPU architecture the kernels are made for: "sm90", "gfx942"
    fp8: str  # torch dtype name of the FP8 weights (and, on the device, of the FP8 activations)
    kv_layout: str  # the KV-cache layout a recipe's `layout: auto` takes (qruntime.kv_layout)
    description: str

    @property
    def fp8_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.fp8)


TARGETS = MappingProxyType(
    {
        "nvidia-sm90": Target(
            "nvidia-sm90",
            "nvidia",
            "sm90",
            "float8_e4m3fn",
            "nhd",
            "NVIDIA Hopper (H100 / H200) and the NVIDIA GPUs that run it",
        ),
        # AITER's paged layout: K [blocks, kv_heads, head_dim/x, block_size, x], V [blocks, kv_heads,
        # block_size/x, head_dim, x], x = 16 bytes of the cache's dtype (gfx942's vector width)
        "amd-gfx942": Target(
            "amd-gfx942", "amd", "gfx942", "float8_e4m3fnuz", "x-packed", "AMD Instinct MI300X / MI308X / MI325X"
        ),
    }
)
DEFAULT_TARGET = "nvidia-sm90"


def get_target(name: str) -> Target:
    """The target named `name`; ValueError naming the known ones."""
    try:
        return TARGETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown target {str(name)[:40]!r}; known: {', '.join(TARGETS)}") from None


def device_target(device: torch.device) -> tuple[str, str] | None:
    """(vendor, arch) of a GPU device ("amd", "gfx942") / ("nvidia", "sm90"), or None for the CPU."""
    import torch

    if device.type != "cuda":
        return None
    if torch.version.hip is not None:
        return "amd", torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
    major, minor = torch.cuda.get_device_capability(device)
    return "nvidia", f"sm{major}{minor}"


def check_device(target: Target, found: tuple[str, str] | None, where: str) -> None:
    """TargetMismatch naming both unless an artifact of `target` runs on a device of (vendor, arch)
    `found` (device_target): the CPU runs every target (the reference ops and Triton's interpreter);
    an NVIDIA target any NVIDIA GPU (its kernels are compiled where they run); an AMD target only
    its own architecture (its FP8 format is that architecture's)."""
    if found is None:
        return
    vendor, arch = found
    if vendor != target.vendor or (target.vendor == "amd" and arch != target.arch):
        raise TargetMismatch(
            f"{where}: compiled for {target.name} ({target.description}), but this GPU is {vendor} {arch}; "
            f"compile the checkpoint again with --target {_suggest(vendor, arch)}"
        )


def _suggest(vendor: str, arch: str) -> str:
    fitting = [t.name for t in TARGETS.values() if t.vendor == vendor and (vendor == "nvidia" or t.arch == arch)]
    return fitting[0] if fitting else f"(none yet: no target for {vendor} {arch})"


def to_e4m3fnuz(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3fn codes and their scale -> the same codes as float8_e4m3fnuz (0x80, e4m3fn's −0 and
    e4m3fnuz's NaN, becomes 0x00) and the scale doubled: fnuz(code) · 2s == fn(code) · s for every
    finite code, exactly (halving and doubling are exact)."""
    import torch

    if codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"to_e4m3fnuz takes float8_e4m3fn codes, got {codes.dtype}")
    raw = codes.view(torch.uint8)
    raw = torch.where(raw == 0x80, torch.zeros_like(raw), raw)
    return raw.view(torch.float8_e4m3fnuz), scale * 2
