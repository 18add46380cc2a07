"""AWQ's scales as a transform of the source tensors, applied while the writer streams them.

A searched group's scales s multiply the input columns of its linears and divide the op before
them: the RMSNorm's weight (q/k/v after input_layernorm, gate/up after post_attention_layernorm,
in a MoE layer the router and every expert's gate/up) or the rows of the previous linear (v_proj's
for o_proj, up_proj's for down_proj, each expert's own). The model's function is unchanged (up to
rounding the new weights to the model dtype; the router's logits too, so the routing); the linears
are then quantized by the scheme's own round to nearest (the router, unquantized, is stored scaled),
so the artifact's format is the plain `w4a16` one.

The transform is small (one fp32 vector per group) and acts on each row chunk the writer reads, so
it keeps the compile's memory bound: nothing of the model is held.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch


@dataclass(frozen=True)
class AwqScales:
    """columns[source]: [cols] factors of a linear's input columns; rows[source]: [rows] divisors
    of a linear's rows or of a 1-D norm weight. `searched`: per layer, per group, how each was
    chosen (for the manifest)."""

    columns: Mapping[str, torch.Tensor]
    rows: Mapping[str, torch.Tensor]
    calibration: tuple[str, str, int]  # file name, sha256, tokens
    searched: tuple[dict, ...] = ()
    config: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", MappingProxyType(dict(self.columns)))
        object.__setattr__(self, "rows", MappingProxyType(dict(self.rows)))

    def sources(self) -> set[str]:
        """The source tensors the transform changes."""
        return set(self.columns) | set(self.rows)

    def apply(self, source: str, start: int, stop: int, chunk: torch.Tensor) -> torch.Tensor:
        """Rows [start, stop) of `source` (read in the model dtype) with the scales applied, computed
        in fp32 and rounded back to the chunk's dtype; an untouched source comes back as it is."""
        col, row = self.columns.get(source), self.rows.get(source)
        if col is None and row is None:
            return chunk
        x = chunk.float()
        if col is not None:
            if x.dim() != 2 or x.shape[1] != col.numel():
                raise ValueError(f"{source}: AWQ column scales of {col.numel()} for a tensor of shape {list(x.shape)}")
            x = x * col
        if row is not None:
            part = row[start:stop]
            if part.numel() != x.shape[0]:
                raise ValueError(f"{source}: AWQ row scales [{start}:{stop}] for a chunk of {x.shape[0]} rows")
            x = x / (part[:, None] if x.dim() == 2 else part)
        return x.to(chunk.dtype)

    def to_dict(self) -> dict:
        """The manifest's `awq` entry: the calibration text, the search and what it chose."""
        name, digest, tokens = self.calibration
        return {
            "calibration": {"file": name, "sha256": digest, "tokens": tokens},
            "search": dict(self.config),
            "groups": list(self.searched),
        }
