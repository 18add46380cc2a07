"""The tensors of a Qwen3-VL checkpoint, by the names and in the layout transformers 5.17 saves them:
the text decoder under `model.language_model.`, each sparse layer's experts stacked
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), the head as
`lm_head.weight`, the vision tower under `model.visual.` (qruntime's `tower_tensor_shapes`).
`qcompile.source.qwen3_vl` reads exactly these back under Qwen3's names."""

from __future__ import annotations

import json
import re

from qruntime.vision.tower_config import VisionTowerConfig
from qruntime.vision.tower_weights import DEFAULT_PREFIX, tower_tensor_shapes

from qcompile.source.model import expected_tensors
from qcompile.source.spec import ModelSpec

TEXT_PREFIX = "model.language_model."
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def checkpoint_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of a complete checkpoint of `spec` (Qwen3 or Qwen3-VL), name -> shape."""
    if spec.vision is None:
        return expected_tensors(spec)
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in expected_tensors(spec).items():
        match = _EXPERT.fullmatch(name)
        if match is None:
            out[name if name == "lm_head.weight" else TEXT_PREFIX + name.removeprefix("model.")] = shape
        elif match.group(2) == "0" and match.group(3) != "up_proj":  # one stacked tensor per layer
            experts, (rows, cols) = spec.moe.num_experts, shape  # type: ignore[union-attr]  # sparse: moe set
            stacked = "gate_up_proj" if match.group(3) == "gate_proj" else "down_proj"
            out[f"{TEXT_PREFIX}layers.{match.group(1)}.mlp.experts.{stacked}"] = (
                (experts, 2 * rows, cols) if stacked == "gate_up_proj" else (experts, rows, cols)
            )
    tower = VisionTowerConfig.from_dict(json.loads(spec.vision.tower_config))
    out |= {DEFAULT_PREFIX + name: shape for name, shape in tower_tensor_shapes(tower).items()}
    return out
