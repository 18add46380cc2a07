"""Small Qwen3-VL ModelSpecs for the text-graph tests: graph_helpers' dense and MoE specs with `vision` set."""

from __future__ import annotations

import dataclasses

from graph_helpers import dense_spec, moe_spec

from qcompile.source.spec import ModelSpec, VisionSpec

# head_dim 16: 8 rotary frequencies, t/h/w sections unequal so a swapped axis shows
MROPE_SECTION = (3, 3, 2)


def vision(deepstack_layers: int = 2, mrope_section: tuple[int, ...] = MROPE_SECTION) -> VisionSpec:
    return VisionSpec(
        mrope_section=mrope_section,  # type: ignore[arg-type]
        image_token_id=7,
        video_token_id=8,
        vision_start_token_id=9,
        spatial_merge_size=2,
        deepstack_layers=deepstack_layers,
        tower_config="{}",
    )


def vl_dense(deepstack_layers: int = 2, dtype: str = "bfloat16", **changes: object) -> ModelSpec:
    """Three dense layers, 4 query / 2 KV heads (tp 2 splits them), DeepStack on the first two."""
    spec = dense_spec(
        dtype=dtype,
        architecture="Qwen3VLForConditionalGeneration",
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vision=vision(deepstack_layers),
    )
    return dataclasses.replace(spec, **changes)


def vl_moe(deepstack_layers: int = 2, dtype: str = "bfloat16", **changes: object) -> ModelSpec:
    """graph_helpers.moe_spec's three layers (the middle one dense), 4 query / 2 KV heads, DeepStack on two."""
    spec = moe_spec(
        dtype=dtype,
        architecture="Qwen3VLMoeForConditionalGeneration",
        num_attention_heads=4,
        num_key_value_heads=2,
        vision=vision(deepstack_layers),
    )
    return dataclasses.replace(spec, **changes)


def text_only(spec: ModelSpec) -> ModelSpec:
    """The same decoder as Qwen3 (no vision)."""
    arch = "Qwen3MoeForCausalLM" if spec.moe is not None else "Qwen3ForCausalLM"
    return dataclasses.replace(spec, architecture=arch, vision=None)
