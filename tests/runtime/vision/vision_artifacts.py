"""A vision graph written as an artifact would hold it: vision.onnx (qcompile's build_vision_graph) with
its weights as external data in a real safetensors file, for the vision encoder tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx
import torch
from safetensors.torch import save_file

from qcompile.graph.onnx_export import TensorLocation, write_onnx
from qcompile.graph.vision_tower import build_vision_graph
from qcompile.io.safetensors_stream import read_header
from qcompile.source.spec import ModelSpec, VisionSpec

WEIGHTS = "weights/vision.safetensors"


def vision_spec(vision_config: dict[str, Any], dtype: str = "float32") -> ModelSpec:
    """A Qwen3-VL ModelSpec (tiny text sizes) whose tower is `vision_config`."""
    vision = VisionSpec(
        mrope_section=(4, 4, 4),
        image_token_id=90,
        video_token_id=91,
        vision_start_token_id=92,
        spatial_merge_size=vision_config["spatial_merge_size"],
        deepstack_layers=len(vision_config["deepstack_visual_indexes"]),
        tower_config=json.dumps(vision_config, sort_keys=True),
    )
    return ModelSpec(
        architecture="Qwen3VLForConditionalGeneration",
        dtype=dtype,
        vocab_size=96,
        hidden_size=vision_config["out_hidden_size"],
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=24,
        intermediate_size=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        vision=vision,
    )


def write_vision_artifact(
    root: Path, vision_config: dict[str, Any], tensors: dict[str, torch.Tensor], dtype: str = "float32"
) -> onnx.ModelProto:
    """root/vision.onnx and root/weights/vision.safetensors: the graph's weights are `tensors` (the
    checkpoint's model.visual.* ones; others are left out), cast to `dtype`."""
    graph = build_vision_graph(vision_spec(vision_config, dtype))
    names = graph.weight_tensors
    (root / "weights").mkdir(parents=True, exist_ok=True)
    save_file({name: tensors[name].to(getattr(torch, dtype)).contiguous() for name in names}, str(root / WEIGHTS))
    entries, _ = read_header(root / WEIGHTS)
    locations = {
        name: TensorLocation(WEIGHTS, e.begin, e.nbytes, e.torch_dtype, e.shape) for name, e in entries.items()
    }
    return write_onnx(graph, locations, root / "vision.onnx")
