"""A Qwen3-VL config.json read into a ModelSpec (docs/vision.md, "Artifacts").

Qwen3VLForConditionalGeneration and Qwen3VLMoeForConditionalGeneration keep the text decoder's sizes in
`text_config` and the tower's in `vision_config`, with the token ids and tie_word_embeddings at the top
level. The config is first checked by qruntime's own reader (qruntime.vision.reference_config), so the
compiler accepts exactly what the runtime's reference forward runs; its ValueError becomes a
CheckpointError naming config.json. What the Qwen3 kernels cannot run (attention biases) is refused by key.
"""

from __future__ import annotations

import json
from typing import Any

from qruntime.shown import shown

from qcompile.errors import CheckpointError

# architecture -> the model_type transformers writes beside it
VL_ARCHITECTURES = {
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
}


def vl_fields(config: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """ModelSpec.from_dict's fields of a Qwen3-VL config.json (`arch` one of VL_ARCHITECTURES), as the
    runtime's reader validates them; ModelSpec.from_config holds the sizes and dtype to its own limits
    (this module stays below qcompile.source.spec). Errors name the key."""
    model_type = config.get("model_type")
    if model_type != VL_ARCHITECTURES[arch]:
        raise CheckpointError(
            f"{source}: 'model_type' is {shown(model_type)}, but architecture {arch} is {VL_ARCHITECTURES[arch]!r}"
        )
    text = config.get("text_config")
    if isinstance(text, dict):
        _refuse_text_keys(text, source)
    # imported here: qruntime.vision imports torch, which a config error must not wait for
    from qruntime.vision.reference_config import ReferenceConfig

    try:
        ref = ReferenceConfig.from_dict(config)
    except ValueError as exc:
        raise CheckpointError(f"{source}: {exc}") from exc
    text = config["text_config"]  # a dict: ReferenceConfig refuses any other
    t = ref.text
    deepstack = len(ref.tower.deepstack_visual_indexes)
    if deepstack > t.num_hidden_layers:
        raise CheckpointError(
            f"{source}: vision_config.deepstack_visual_indexes lists {deepstack} blocks, but the text model has "
            f"{t.num_hidden_layers} layers (DeepStack feature i is added after text layer i)"
        )
    moe = None
    if t.moe is not None:
        moe = {
            "num_experts": t.moe.num_experts,
            "num_experts_per_tok": t.moe.num_experts_per_tok,
            "moe_intermediate_size": t.moe.moe_intermediate_size,
            "norm_topk_prob": True,  # transformers renormalizes Qwen3-VL MoE's top-k weights always
            "decoder_sparse_step": t.moe.decoder_sparse_step,
            "mlp_only_layers": tuple(sorted(set(t.moe.mlp_only_layers))),
        }
    vision = {
        "mrope_section": ref.rope.mrope_section,
        "image_token_id": ref.tokens.image_token_id,
        "video_token_id": ref.tokens.video_token_id,
        "vision_start_token_id": ref.tokens.vision_start_token_id,
        "spatial_merge_size": ref.tower.spatial_merge_size,
        "deepstack_layers": deepstack,
        "tower_config": json.dumps(config["vision_config"], sort_keys=True),
    }
    return {
        "architecture": arch,
        # text_config's dtype, else the top-level dtype / torch_dtype, else bfloat16 (checked by the caller)
        "dtype": text.get("dtype") or config.get("dtype") or config.get("torch_dtype") or "bfloat16",
        "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "num_hidden_layers": t.num_hidden_layers,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim,
        "intermediate_size": text.get("intermediate_size"),  # checked by the caller, as max_position_embeddings
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": float(ref.rope.rope_theta),
        "max_position_embeddings": text.get("max_position_embeddings"),
        "tie_word_embeddings": ref.tie_word_embeddings,
        "moe": moe,
        "vision": vision,
    }


def _refuse_text_keys(text: dict[str, Any], source: str) -> None:
    """What qruntime's reference runs but the Qwen3 kernels do not, and the non-interleaved M-RoPE
    layout (refused by qruntime too; named here by its place in config.json)."""
    if text.get("attention_bias", False) is True:
        raise CheckpointError(f"{source}: text_config.attention_bias=true is not supported by Qwen3 kernels")
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, dict) and rope.get("mrope_interleaved", True) is not True:
            raise CheckpointError(
                f"{source}: text_config.{key}.mrope_interleaved is {shown(rope['mrope_interleaved'])}; only the "
                "interleaved M-RoPE layout of Qwen3-VL is supported"
            )
