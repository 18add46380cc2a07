"""Split an artifact's fused tensors back into the source checkpoint's names, losslessly.

Fused and stacked weights record their parts in the manifest; splitting only slices rows, so each
source tensor comes back with exactly the bytes (and scale) it was quantized to. This is what
`qcompile export` builds on, and how tests compare us with llm-compressor byte for byte. Scales come
back as compressed-tensors stores them: per-tensor scales, which the artifact repeats on each row
of their source's part, as the one value of shape [1]. Packed int4 weights (w4a16) come back packed,
their rows of int32 words, and with zero points (w4a16-zp) each source's rows of uint8 zero-point
codes; `compressed_names` gives the names compressed-tensors stores them under (`weight_packed`,
`weight_scale`, the logical `weight_shape` and `weight_zero_point`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from qruntime.artifact import ArtifactFormatError, artifact_path, read_manifest
from qruntime.manifest_schema import QUANT_PARAM_ROLES
from safetensors import SafetensorError, safe_open

from qcompile.compile.jobs import split_rows
from qcompile.errors import ArtifactError
from qcompile.quant import QuantScheme, get_scheme


def split_to_sources(root: str | Path) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """Yield (source tensor name, weight, scale or None) for every weight of the artifact.

    An FP8 lm_head made from tied embeddings is reported as `lm_head.weight`, beside the
    embedding table itself. A packed int4 weight comes as its packed rows (int32 [rows, cols / 8]).
    """
    for name, weight, scale, _, _ in split_with_schemes(root):
        yield name, weight, scale


def split_with_schemes(
    root: str | Path,
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None, QuantScheme, torch.Tensor | None]]:
    """`split_to_sources`, each source with the scheme its weight was stored in and its zero-point
    rows (uint8 codes [rows, cols / group_size]; None but for scheme `w4a16-zp`)."""
    root = Path(root)
    manifest = read_manifest(root)
    if manifest.get("tp", 1) != 1:
        raise ArtifactError(
            f"{root}: sharded for tp={manifest['tp']}; only a tp=1 artifact splits back into the source's tensors"
        )
    tensors = manifest["tensors"]
    handles: dict[str, Any] = {}

    def load(name: str) -> Any:
        """A lazy slice: indexing it reads only those rows (one source part, or one expert's
        slice of a stacked tensor), so memory holds one part at a time, not a fused tensor."""
        file = tensors[name]["file"]
        if file not in handles:
            try:
                path = artifact_path(root, file, listed=manifest["files"])
            except ArtifactFormatError as exc:
                raise ArtifactError(str(exc)) from exc
            try:
                handles[file] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise ArtifactError(f"{path}: not a readable safetensors file ({exc})") from exc
        try:
            return handles[file].get_slice(name)
        except SafetensorError as exc:
            raise ArtifactError(
                f"{root / file}: has no tensor {name[:200]!r} that manifest.json places there ({exc})"
            ) from exc

    for name, info in tensors.items():
        if info["role"] in QUANT_PARAM_ROLES:
            continue
        scale_name, zp_name = scale_of(name), zero_point_of(name)
        scale = load(scale_name) if scale_name in tensors else None
        zero_point = load(zp_name) if zp_name in tensors else None
        layout = [[tuple(part) for part in group] for group in info["parts"]]
        scheme = get_scheme(info["scheme"])
        # one code per group scale, so the same rows (zero points are 1/64 of the packed weight's bytes)
        zsplit = {} if zero_point is None else split_rows(layout, info["stacked"], 1, zero_point, None)
        for source, (weight, srows) in split_rows(layout, info["stacked"], scheme.row_align, load(name), scale).items():
            if scheme.per_tensor and srows is not None:
                srows = _one_value(srows, scale_name, source)
            zrows = zsplit[source][0] if source in zsplit else None
            yield ("lm_head.weight" if info["role"] == "lm_head" else source), weight, srows, scheme, zrows


def split_zero_points(root: str | Path) -> dict[str, torch.Tensor]:
    """{source tensor name: its zero-point rows (uint8 codes [rows, cols / group_size])} for every
    weight of an asymmetric int4 artifact (scheme `w4a16-zp`); empty for any other."""
    return {name: zp for name, _, _, _, zp in split_with_schemes(root) if zp is not None}


def scale_of(weight: str) -> str:
    """The artifact's name of the scale of weight tensor `weight` (`X.weight` or `X.weight_packed`)."""
    return weight.rpartition(".")[0] + ".weight_scale"


def zero_point_of(weight: str) -> str:
    """The artifact's (and compressed-tensors') name of the zero points of weight tensor `weight`."""
    return weight.rpartition(".")[0] + ".weight_zero_point"


def compressed_names(source: str, scheme: QuantScheme) -> tuple[str, str, str | None]:
    """(weight, scale, shape) names that compressed-tensors gives source tensor `source` (`X.weight`)
    under `scheme`: `X.weight`, `X.weight_scale`, no shape tensor; packed int4 `X.weight_packed`,
    `X.weight_scale` and `X.weight_shape` (the int64 [rows, columns] of the unpacked weight)."""
    module = source.removesuffix(".weight")
    if scheme.weight_key == "weight":
        return source, f"{module}.weight_scale", None
    return f"{module}.{scheme.weight_key}", f"{module}.weight_scale", f"{module}.weight_shape"


def _one_value(rows: torch.Tensor, scale_name: str, source: str) -> torch.Tensor:
    """The [1] per-tensor scale of `source` from its rows of `scale_name`, which must all hold it."""
    value = rows.reshape(-1)[:1]
    if not bool((rows == value).all()):
        raise ArtifactError(
            f"{scale_name}: the rows of per-tensor scale part {source!r} hold different values; the artifact "
            "is damaged (run `qcompile verify`)"
        )
    return value.clone()
