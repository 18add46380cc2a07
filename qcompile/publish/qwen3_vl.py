"""What a Qwen3-VL artifact's compressed-tensors export changes: the names transformers 5.17 loads.

The compiler reads a Qwen3-VL checkpoint's text model under Qwen3's names (docs/vision.md,
"Artifacts"), so `split_to_sources` gives `model.X` and per-expert `mlp.experts.{e}.*_proj.weight`.
The export writes them back as `Qwen3VLForConditionalGeneration` / `Qwen3VLMoeForConditionalGeneration`
hold them: `model.language_model.X`, the tower's `model.visual.*` and `lm_head.weight` unchanged, and
a sparse layer's experts as the two stacked parameters transformers 5.17 has (what its
`save_pretrained` writes): `mlp.experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its
up rows) and `mlp.experts.down_proj` [E, H, I].

Quantized experts cannot be exported for Qwen3-VL-MoE: transformers 5.17 builds its experts as those
3-D parameters (not Linear modules) and dequantizes compressed-tensors experts only for models whose
checkpoints name them one by one (the Qwen3-MoE family's converter); per-expert FP8 tensors of a
Qwen3-VL-MoE are dropped as unexpected keys and the experts left at random init. So only unquantized
experts are written, and an artifact with quantized ones is refused (`check_expert_scheme`).
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from qcompile.errors import ExportError
from qcompile.io.safetensors_stream import OutputTensor

TEXT_PREFIX = "model.language_model."
VISUAL_PREFIX = "model.visual."
PREPROCESSOR_FILE = "preprocessor_config.json"
VIDEO_PREPROCESSOR_FILE = "video_preprocessor_config.json"
# llm-compressor's Qwen3-VL examples: the tower stays unquantized, under vLLM's names (`visual.`)
# and transformers' (`model.visual.`)
VISION_IGNORE = ("re:visual.*", "re:model.visual.*")
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
_STACKED = {"gate": "gate_up_proj", "up": "gate_up_proj", "down": "down_proj"}

ExpertPart = tuple[str, torch.dtype, tuple[int, ...]]  # (source name, dtype, shape [rows, cols])


def is_vision(manifest: dict[str, Any]) -> bool:
    """Whether the artifact is a Qwen3-VL one (it has the manifest's `vision` entry)."""
    return manifest.get("vision") is not None


def checkpoint_name(name: str) -> str:
    """The Qwen3-VL checkpoint's name of tensor `name` as the compiler reads it (Qwen3's)."""
    if name.startswith("model.") and not name.startswith(VISUAL_PREFIX):
        return TEXT_PREFIX + name.removeprefix("model.")
    return name


def expert_stack(source: str) -> str | None:
    """The stacked checkpoint tensor that per-expert source `source` is a slice of, or None."""
    match = _EXPERT.fullmatch(source)
    return None if match is None else checkpoint_name(f"{match[1]}.{_STACKED[match[3]]}")


def check_expert_scheme(source: str, scheme: str, quantized: bool) -> None:
    """Refuse a quantized expert: transformers 5.17 cannot load it for Qwen3-VL-MoE (module docstring)."""
    if quantized:
        raise ExportError(
            f"manifest.json: expert weight {source!r} is quantized ({scheme}); a Qwen3-VL-MoE export holds "
            "its experts as transformers 5.17's stacked mlp.experts.gate_up_proj / down_proj parameters, "
            "which compressed-tensors cannot quantize (transformers dequantizes per-expert FP8/int4 experts "
            "only for Qwen3-MoE-style checkpoints and would leave these at random init): export an "
            "artifact compiled with the bf16 recipe, or with the experts in the recipe's ignore list"
        )


def stack_layout(stack: str, parts: list[ExpertPart]) -> tuple[OutputTensor, dict[str, int]]:
    """The stacked tensor `stack` made of `parts` and each part's byte offset in it: [E, g + u, H]
    for gate_up_proj (expert e's gate rows, then its up rows), [E, H, I] for down_proj. Every expert
    0..E-1 must be there once, all of one dtype and shape."""
    by_expert: dict[int, dict[str, ExpertPart]] = {}
    for part in parts:
        match = _EXPERT.fullmatch(part[0])
        if match is None:
            raise ValueError(f"{part[0]!r} is not an expert's weight")
        slots = by_expert.setdefault(int(match[2]), {})
        if match[3] in slots:
            raise ExportError(f"manifest.json: expert weight {part[0]!r} comes twice")
        slots[match[3]] = part
    kinds = ("gate", "up") if stack.endswith(".gate_up_proj") else ("down",)
    first = by_expert.get(0, {})
    if sorted(by_expert) != list(range(len(by_expert))) or any(k not in first for k in kinds):
        raise ExportError(
            f"manifest.json: the experts of {stack!r} are {sorted(by_expert)} with {sorted(first)} weights; "
            f"a stacked tensor needs experts 0..E-1, each with its {' and '.join(kinds)} weight"
        )
    dtype, cols = first[kinds[0]][1], first[kinds[0]][2][1]  # expert 0's first kind sets them for all
    want = {kind: (dtype, (first[kind][2][0], cols)) for kind in kinds}
    rows = [want[kind][1][0] for kind in kinds]
    if len(set(rows)) != 1:  # transformers halves gate_up_proj's rows into gate and up
        raise ExportError(f"manifest.json: the experts of {stack!r} have {rows[0]} gate rows but {rows[1]} up rows")
    offsets: dict[str, int] = {}
    for expert, got in sorted(by_expert.items()):
        for i, kind in enumerate(kinds):
            part = got.get(kind)
            if part is None or part[1:] != want[kind]:
                shown = "missing" if part is None else f"{part[1]} {list(part[2])}"
                raise ExportError(
                    f"manifest.json: expert {expert} of {stack!r}: its {kind} weight is {shown}, but the stacked "
                    f"tensor needs {want[kind][0]} {list(want[kind][1])} (expert 0's; one dtype and width for all)"
                )
            offsets[part[0]] = (expert * sum(rows) + sum(rows[:i])) * cols * dtype.itemsize
    return OutputTensor(stack, dtype, (len(by_expert), sum(rows), cols)), offsets


def vision_quantization_config(qconfig: dict[str, Any]) -> dict[str, Any]:
    """`qconfig` with the tower in its ignore list (VISION_IGNORE, after the recipe's own entries)."""
    ignore = list(qconfig.get("ignore", []))
    return qconfig | {"ignore": ignore + [p for p in VISION_IGNORE if p not in ignore]}


def preprocessor_json(manifest: dict[str, Any]) -> str:
    """preprocessor_config.json as the artifact records it (manifest["vision"]["preprocessor"])."""
    preprocessor = manifest["vision"].get("preprocessor")
    if not isinstance(preprocessor, dict):
        raise ExportError("manifest.json: vision.preprocessor must be the preprocessor_config.json object")
    return json.dumps(preprocessor, indent=2) + "\n"


def video_preprocessor_json(manifest: dict[str, Any]) -> str | None:
    """video_preprocessor_config.json as the artifact records it (manifest["vision"]["video_preprocessor"]);
    None when it records none (the source checkpoint had none)."""
    video = manifest["vision"].get("video_preprocessor")
    if video is None:
        return None
    if not isinstance(video, dict):
        raise ExportError("manifest.json: vision.video_preprocessor must be the video_preprocessor_config.json object")
    return json.dumps(video, indent=2) + "\n"
