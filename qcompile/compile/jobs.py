"""WeightJob: one artifact weight made from source tensors — copied, fused, stacked, quantized.

The graph declares the weights its nodes read as WeightJobs; the writer executes them; the
manifest records them, so a fused tensor can always be split back into its source tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import torch

from qcompile.io.safetensors_stream import OutputTensor
from qcompile.quant import QuantScheme, get_scheme

ROLES = ("embedding", "norm", "linear", "router", "lm_head", "vision")  # vision: a tower tensor (vision.onnx)
Layout = list[list[tuple[str, int, int]]]  # per slice: (source, first row, end row) of each part


@dataclass(frozen=True)
class WeightJob:
    """Artifact tensor `{name}.weight` (and `{name}.weight_scale` when quantized; packed int4 is
    `{name}.weight_packed`, as compressed-tensors names it, and asymmetric int4 adds the zero points
    `{name}.weight_zero_point`, uint8 codes shaped like the scale).

    `sources[s]` lists the source tensors whose rows are concatenated (in order) to make slice `s`;
    with `stacked` the slices are stacked along a new first axis ([E, rows, cols], experts), without
    it there is exactly one slice ([rows, cols], or the source's own shape for a 1-D copy).
    """

    name: str
    sources: tuple[tuple[str, ...], ...]
    stacked: bool
    scheme: str
    role: str
    fp8: str = "float8_e4m3fn"  # the FP8 format of a quantized weight (the compile target's)

    def __post_init__(self) -> None:
        if not self.sources or not all(self.sources):
            raise ValueError(f"{self.name}: a weight job needs at least one source tensor")
        if not self.stacked and len(self.sources) != 1:
            raise ValueError(f"{self.name}: an unstacked job has exactly one slice of sources")
        if self.role not in ROLES:
            raise ValueError(f"{self.name}: unknown role {self.role!r}")

    @property
    def quant(self) -> QuantScheme:
        scheme = get_scheme(self.scheme)
        return scheme if scheme.fp8 == self.fp8 else replace(scheme, fp8=self.fp8)

    @property
    def weight_name(self) -> str:
        return f"{self.name}.{self.quant.weight_key}"

    @property
    def scale_name(self) -> str | None:
        return f"{self.name}.weight_scale" if self.quant.quantized else None

    @property
    def zero_point_name(self) -> str | None:
        return f"{self.name}.weight_zero_point" if self.quant.zero_point else None

    @property
    def quant_names(self) -> tuple[str, ...]:
        """The tensors a linear op reads for this weight, in its input order: weight, scale, zero point."""
        names = (self.weight_name, self.scale_name, self.zero_point_name)
        return tuple(n for n in names if n is not None)

    def source_names(self) -> Iterator[str]:
        for group in self.sources:
            yield from group

    def part_rows(self, shapes: Mapping[str, tuple[int, ...]]) -> Layout:
        """For each slice, (source, first row, end row) of every part in the fused tensor."""
        layout = []
        for group in self.sources:
            start, parts = 0, []
            for src in group:
                parts.append((src, start, start + shapes[src][0]))
                start += shapes[src][0]
            layout.append(parts)
        return layout

    def weight_shape(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The logical shape of the weight (the sources' rows and columns); the stored tensor's is
        `quant.stored_shape` of it (packed int4: 8 columns per int32)."""
        first = shapes[self.sources[0][0]]
        if len(first) == 1:
            if len(self.sources[0]) != 1 or self.stacked:
                raise ValueError(f"{self.name}: 1-D tensors cannot be fused or stacked")
            return first
        rows = sum(shapes[s][0] for s in self.sources[0])
        for group in self.sources:
            if sum(shapes[s][0] for s in group) != rows or any(shapes[s][1:] != first[1:] for s in group):
                raise ValueError(f"{self.name}: sources of different shapes cannot be stacked")
        return (len(self.sources), rows, *first[1:]) if self.stacked else (rows, *first[1:])

    def outputs(self, shapes: Mapping[str, tuple[int, ...]], model_dtype: torch.dtype) -> list[OutputTensor]:
        """The tensors this job writes, with their dtypes and shapes."""
        shape = self.weight_shape(shapes)
        stored = self.quant.stored_shape(shape)
        out = [OutputTensor(self.weight_name, self.quant.weight_dtype(model_dtype), stored)]
        if self.scale_name is not None:
            scale = self.quant.scale_shape(shape[-2:])
            assert scale is not None
            out.append(OutputTensor(self.scale_name, model_dtype, (*shape[:-2], *scale)))
            if self.zero_point_name is not None:
                out.append(OutputTensor(self.zero_point_name, torch.uint8, (*shape[:-2], *scale)))
        return out


def split_rows(
    layout: Layout, stacked: bool, row_align: int, weight: torch.Tensor, scale: torch.Tensor | None
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Split a written weight (and scale) back into {source name: (weight rows, scale rows)}.

    Lossless: fusing only concatenates and stacks rows, and a row's bytes and scale never depend
    on its neighbours (block scales need every part aligned to the block, which the fusion
    passes check).
    """
    out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for s, parts in enumerate(layout):
        w = weight[s] if stacked else weight
        sc = None if scale is None else (scale[s] if stacked else scale)
        for src, begin, end in parts:
            srows = None
            if sc is not None:
                srows = sc[begin:end] if row_align == 1 else sc[begin // row_align : -(-end // row_align)]
            out[src] = (w[begin:end], srows)
    return out
