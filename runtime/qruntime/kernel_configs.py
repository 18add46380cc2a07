"""Tuned kernel configs of an artifact (kernels/<device>.json, docs/ARTIFACT.md), per GPU model.

    {"device": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "torch": ..., "triton": ...,
     "entries": {"<op>:<shape key>": {"<max tokens>": {"backend": "triton" | "cublaslt", ...config}}}}

A step with T tokens uses the smallest bucket >= T (the largest bucket beyond the last). The file of
another GPU model is never used; the runtime never autotunes at load.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

KERNELS_DIR = "kernels"


def device_file(device_name: str) -> str:
    """File name of a GPU model's table: its name with anything but letters, digits, '.', '-' as '_'."""
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", device_name).strip("_") + ".json"


@dataclass(frozen=True)
class KernelTable:
    device: str
    entries: Mapping[str, tuple[tuple[int, Mapping[str, Any]], ...]]  # key -> ((max_tokens, config), ...) ascending

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> KernelTable:
        try:
            entries = {
                key: tuple(sorted((int(bucket), MappingProxyType(dict(cfg))) for bucket, cfg in buckets.items()))
                for key, buckets in data["entries"].items()
            }
            return cls(str(data["device"]), MappingProxyType(entries))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{where}: not a kernel-config table ({exc!r})") from exc

    def lookup(self, key: str, tokens: int) -> Mapping[str, Any] | None:
        """The config tuned for `key` at `tokens` tokens, or None when the key was not tuned."""
        buckets = self.entries.get(key)
        if not buckets:
            return None
        index = bisect_left([b for b, _ in buckets], tokens)
        return buckets[min(index, len(buckets) - 1)][1]


def load_kernel_table(root: str | Path, device_name: str) -> KernelTable | None:
    """The artifact's table for GPU model `device_name`, or None when it has none."""
    path = Path(root) / KERNELS_DIR / device_file(device_name)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable kernel-config table ({exc})") from exc
    table = KernelTable.from_dict(data, str(path))
    if table.device != device_name:
        raise ValueError(f"{path}: tuned for {table.device!r}, not for this GPU ({device_name!r})")
    return table
