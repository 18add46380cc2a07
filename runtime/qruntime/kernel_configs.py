"""Tuned kernel configs of an artifact (kernels/<device>.json, docs/ARTIFACT.md), per GPU model.

    {"device": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "torch": ..., "triton": ...,
     "entries": {"<op>:<shape key>": {"<max tokens>": {"backend": "triton" | "cublaslt", ...config}}}}

A step with T tokens uses the smallest bucket >= T (the largest bucket beyond the last). The file of
another GPU model is never used; the runtime never autotunes at load.

Every value is checked at load (`check_config`): a table that would crash a step (a block size that
is not a power of two, a backend nobody knows, a string where a count goes) is a ValueError naming the
file and the key, before the engine runs. The file is the artifact's own: listed by its manifest,
reached through no link (qruntime.artifact.artifact_path), its JSON bounded (qruntime.bounded_json).
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Container, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from qruntime import bounded_json
from qruntime.artifact import ArtifactFormatError, optional_artifact_path

KERNELS_DIR = "kernels"
MAX_BUCKET = 1 << 31  # token counts a bucket may name
BACKENDS = ("triton", "cublaslt")
# key prefix -> {config key: (least, most)} of the powers of two it holds; num_stages is any count in STAGES
_GEMM = {"block_m": (16, 512), "block_n": (16, 512), "block_k": (16, 512), "split_k": (1, 1024), "num_warps": (1, 16)}
_TILE = {"block_n": (16, 512), "block_k": (32, 512), "num_warps": (1, 16)}
_GEMV_TILE = {"block_n": (1, 256), "block_k": (16, 8192), "num_warps": (1, 16)}
POW2_KEYS: Mapping[str, Mapping[str, tuple[int, int]]] = MappingProxyType(
    {
        "PTPCLinear": MappingProxyType(_GEMM),
        "W4A16Linear": MappingProxyType(_GEMM),
        "MoE": MappingProxyType(
            {"block_m": (16, 512)} | {f"{g}_{k}": r for g in ("w13", "w2") for k, r in _TILE.items()}
        ),
        # a MoE record with `gemv: 1`: one token's projections as GEMVs (kernels/moe_gemv.py)
        # a PTPCLinear or W4A16Linear record with `block_m: 1`: the one-token GEMV (fp8_gemm.py, w4a16_gemm.py)
        "PTPCGemv": MappingProxyType(
            {"block_m": (1, 1), "block_n": (1, 256), "block_k": (16, 8192), "split_k": (1, 1), "num_warps": (1, 16)}
        ),
        "MoEGemv": MappingProxyType({f"{g}_{k}": r for g in ("up", "down") for k, r in _GEMV_TILE.items()}),
    }
)
STAGE_KEYS = MappingProxyType(
    {
        "PTPCLinear": ("num_stages",),
        "PTPCGemv": ("num_stages",),
        "W4A16Linear": ("num_stages",),
        "MoE": ("w13_num_stages", "w2_num_stages"),
    }
)
# key prefix -> {config key: (least, most)} of the integers it holds
# (each rank maps two data halves of the larger AllReduce limit)
INT_KEYS = MappingProxyType(
    {"AllReduce": MappingProxyType({"max_one_shot_bytes": (0, 1 << 26), "max_two_shot_bytes": (0, 1 << 26)})}
)
# key prefix -> {config key: (least, most, multiple of)}: integers a table may leave out (tables tuned
# before the key existed); the LL kernel's limit is whole 4-byte words (qruntime.comm.all_reduce)
OPTIONAL_INT_KEYS = MappingProxyType({"AllReduce": MappingProxyType({"max_ll_bytes": (0, 1 << 20, 4)})})
STAGES = (1, 16)


def device_file(device_name: str) -> str:
    """File name of a GPU model's table: its name with anything but letters, digits, '.', '-' as '_'."""
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", device_name).strip("_") + ".json"


@dataclass(frozen=True)
class KernelTable:
    device: str
    entries: Mapping[str, tuple[tuple[int, Mapping[str, Any]], ...]]  # key -> ((max_tokens, config), ...) ascending

    @classmethod
    def from_dict(cls, data: Any, where: str) -> KernelTable:
        """The table of parsed JSON `data`; a ValueError naming `where` and the key at fault otherwise."""
        if not isinstance(data, dict) or not isinstance(data.get("device"), str):
            raise ValueError(f"{where}: not a kernel-config table (an object with a string `device`)")
        if not isinstance(data.get("entries"), dict):
            raise ValueError(f"{where}: entries must be an object of op keys")
        entries = {}
        for key, buckets in data["entries"].items():
            at = f"{where}: entries[{key[:80]!r}]"
            if not isinstance(buckets, dict) or not buckets:
                raise ValueError(f"{at} must be an object from token counts to configs")
            rows = []
            for bucket, cfg in buckets.items():
                if not bucket.isdigit() or not 1 <= int(bucket) <= MAX_BUCKET:
                    raise ValueError(f"{at}: bucket {bucket[:20]!r} is not a token count in 1..{MAX_BUCKET}")
                check_config(key, cfg, f"{at}[{bucket!r}]")
                rows.append((int(bucket), MappingProxyType(dict(cfg))))
            entries[key] = tuple(sorted(rows, key=lambda row: row[0]))
        return cls(data["device"], MappingProxyType(entries))

    def lookup(self, key: str, tokens: int) -> Mapping[str, Any] | None:
        """The config tuned for `key` at `tokens` tokens, or None when the key was not tuned."""
        buckets = self.entries.get(key)
        if not buckets:
            return None
        index = bisect_left([b for b, _ in buckets], tokens)
        return buckets[min(index, len(buckets) - 1)][1]


def check_config(key: str, cfg: Any, where: str) -> None:
    """One bucket's config of op key `key` ("PTPCLinear:NxK", "MoE:...", "AllReduce:tpN"): a backend this runtime has,
    and, for the Triton kernels, every launch parameter an integer in its range (block sizes, splits
    and warps powers of two). Other keys (a tuner's timings) are not read. ValueError names `where`."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{where} must be an object (a backend and its launch config)")
    backend = cfg.get("backend", "triton")
    if backend not in BACKENDS:
        raise ValueError(f"{where}.backend must be one of {', '.join(BACKENDS)} (got {str(backend)[:40]!r})")
    op = key.split(":", 1)[0]
    if op == "MoE" and "gemv" in cfg:
        if cfg["gemv"] != 1 or isinstance(cfg["gemv"], bool):
            raise ValueError(
                f"{where}.gemv must be 1 (one token's GEMV path) when present (got {str(cfg['gemv'])[:40]})"
            )
        op = "MoEGemv"
    if op == "PTPCLinear" and "folded" in cfg:  # the choice when the reader sums the split-K partials
        folded = cfg["folded"]
        if isinstance(folded, dict) and "folded" in folded:
            raise ValueError(f"{where}.folded must not hold another 'folded'")
        check_config(key, folded, f"{where}.folded")
    if op in ("PTPCLinear", "W4A16Linear") and cfg.get("block_m") == 1:
        op = "PTPCGemv"  # the one-token GEMV of either (W4A16Config documents the same fields and bounds)
    if backend == "cublaslt":
        if op != "PTPCLinear":
            raise ValueError(f"{where}.backend: cublaslt runs PTPCLinear only, not {op[:40]!r}")
        return
    for name, (least, most) in POW2_KEYS.get(op, {}).items():
        value = cfg.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most or value & (value - 1):
            raise ValueError(f"{where}.{name} must be a power of two in {least}..{most} (got {str(value)[:40]})")
    for name, (least, most) in INT_KEYS.get(op, {}).items():
        value = cfg.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
            raise ValueError(f"{where}.{name} must be an integer in {least}..{most} (got {str(value)[:40]})")
    for name, (least, most, step) in OPTIONAL_INT_KEYS.get(op, {}).items():
        value = cfg.get(name, least)
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most or value % step:
            raise ValueError(
                f"{where}.{name} must be a multiple of {step} in {least}..{most} when present (got {str(value)[:40]})"
            )
    for name in STAGE_KEYS.get(op, ()):
        value = cfg.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not STAGES[0] <= value <= STAGES[1]:
            raise ValueError(f"{where}.{name} must be an integer in {STAGES[0]}..{STAGES[1]} (got {str(value)[:40]})")


def load_kernel_table(root: str | Path, device_name: str, listed: Container[str] | None = None) -> KernelTable | None:
    """The artifact's table for GPU model `device_name`, or None when it has none. `listed`: the
    manifest's files (a table present but not listed is refused)."""
    rel = f"{KERNELS_DIR}/{device_file(device_name)}"
    try:
        path = optional_artifact_path(root, rel, listed=listed)
    except ArtifactFormatError as exc:
        raise ValueError(str(exc)) from None
    if path is None:
        return None
    try:
        data = bounded_json.loads(path.read_bytes(), what=str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable kernel-config table ({exc})") from exc
    table = KernelTable.from_dict(data, str(path))
    if table.device != device_name:
        raise ValueError(f"{path}: tuned for {table.device!r}, not for this GPU ({device_name!r})")
    return table
