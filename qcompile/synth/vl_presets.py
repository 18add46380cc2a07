"""Qwen3-VL presets for `qcompile synth`: the config.json files Qwen published, as data.

Key order and values follow the published files (transformers 4.57.0.dev0 wrote them: `rope_scaling`
and `rope_theta` inside text_config). Where each size's values were read (no weights were downloaded):

- 2B:  a verbatim copy of the Instruct config.json in a public Rust crate's tests (WeVisDoc, a Qwen3-VL
       checkpoint loader: "parses_official_checkpoint_shape"), agreeing with a vLLM fusion-bench note
       (hidden 2048, 28 layers) and sgl-jax's Qwen3VLVisionConfig defaults (depth 24, hidden 1024,
       deepstack [5, 11, 17], out 2048).
- 4B:  DiffSynth's WanMLLMEncoder (the whole config, written out), agreeing with two notes that read
       Qwen/Qwen3-VL-4B-Instruct/config.json (text 36 x 2560, 32 / 8 heads, intermediate 9728, tied,
       rope_theta 5e6, section [24, 20, 20]; tower depth 24, hidden 1024, deepstack [5, 11, 17]).
- 8B, 30B-A3B: "模型信息报告" model reports quoting the raw config.json of Qwen3-VL-8B-Instruct and
       Qwen3-VL-30B-A3B-Instruct, with their weight tables (30B-A3B: experts stored as
       gate_up_proj [128, 2048, 1536]) and totals 8,767,123,696 and 31,070,754,032 parameters.
- 32B: an architecture note verified against Qwen/Qwen3-VL-32B-Instruct/config.json (64 x 5120,
       64 / 8 heads, intermediate 25600, untied, tower depth 27 / 1152 / out 5120, deepstack
       [8, 16, 24]), agreeing with MiniMax-H3's checks of its Qwen3-VL-32B-Instruct text encoder
       (rope_theta 5e6, rms_norm_eps 1e-6, head_dim 128, vocab 151936).
- 235B-A22B: the same kind of model report (transformers 5.7's re-serialization of the config:
       `rope_parameters`, `num_local_experts`; total 235,670,022,896 parameters) and an architecture
       note verified against the raw file (94 x 4096, 64 / 4 heads, 128 experts top 8, moe 1536,
       section [24, 20, 20], tower depth 27 / out 4096, deepstack [8, 16, 24]).

Every size has the same token ids (image 151655, video 151656, vision start 151652 / end 151653:
Qwen's `<|image_pad|>`, `<|video_pad|>`, `<|vision_start|>`, `<|vision_end|>`), the same
preprocessor_config.json (qruntime.vision.preprocess.QWEN3_VL) and, apart from the depth-24 tower of
2B / 4B, the same depth-27 tower.
"""

from __future__ import annotations

from typing import Any

from qruntime.vision.preprocess import QWEN3_VL

QWEN_BOS_ID, QWEN_EOS_ID, QWEN_VOCAB_SIZE = 151643, 151645, 151936
# offsets of the vision tokens among Qwen's added tokens (qcompile.synth.tokenizer.QWEN_ADDED_TOKENS)
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 9, 10, 12, 13
MROPE_SECTION = [24, 20, 20]
SMALL_TOWER = dict(depth=24, hidden_size=1024, intermediate_size=4096, deepstack_visual_indexes=[5, 11, 17])
LARGE_TOWER = dict(depth=27, hidden_size=1152, intermediate_size=4304, deepstack_visual_indexes=[8, 16, 24])


def vision_config(
    tower: dict[str, Any], out_hidden: int, model_type: str = "qwen3_vl", **changed: Any
) -> dict[str, Any]:
    """vision_config, keys in the published order."""
    config = {
        "deepstack_visual_indexes": tower["deepstack_visual_indexes"],
        "depth": tower["depth"],
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": tower["hidden_size"],
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": tower["intermediate_size"],
        "model_type": model_type,
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": out_hidden,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return _changed(config, changed)


def text_config(
    hidden: int, inter: int, layers: int, heads: int, kv: int, *, bos: int = QWEN_BOS_ID, **changed: Any
) -> dict[str, Any]:
    """A dense text_config, keys in the published order (2B / 4B also carry tie_word_embeddings)."""
    config = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "dtype": "bfloat16",
        "eos_token_id": bos + 2,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": MROPE_SECTION, "rope_type": "default"},
        "rope_theta": 5000000,
        "use_cache": True,
        "vocab_size": QWEN_VOCAB_SIZE,
    }
    return _changed(config, changed)


def moe_text_config(text: dict[str, Any], moe_inter: int, experts: int, top_k: int, **changed: Any) -> dict[str, Any]:
    """A dense text_config made Qwen3-VL-MoE's (its extra keys in the published order)."""
    out: dict[str, Any] = {}
    for key, value in text.items():
        out[key] = "qwen3_vl_moe_text" if key == "model_type" else value
        if key == "bos_token_id":
            out["decoder_sparse_step"] = 1
        elif key == "max_position_embeddings":
            out["mlp_only_layers"] = []
        elif key == "model_type":
            out |= {"moe_intermediate_size": moe_inter, "norm_topk_prob": True}
        elif key == "num_attention_heads":
            out |= {"num_experts": experts, "num_experts_per_tok": top_k}
    return _changed(out, changed)


def vl_config(text: dict[str, Any], vision: dict[str, Any], tied: bool) -> dict[str, Any]:
    """The top level of a Qwen3-VL config.json; token ids laid out from text_config's bos id."""
    moe = text["model_type"] == "qwen3_vl_moe_text"
    bos = text["bos_token_id"]
    return {
        "architectures": ["Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"],
        "image_token_id": bos + IMAGE_PAD,
        "model_type": "qwen3_vl_moe" if moe else "qwen3_vl",
        "text_config": text,
        "tie_word_embeddings": tied,
        "transformers_version": "4.57.0.dev0",
        "video_token_id": bos + VIDEO_PAD,
        "vision_config": vision,
        "vision_end_token_id": bos + VISION_END,
        "vision_start_token_id": bos + VISION_START,
    }


def published_preprocessor(vision: dict[str, Any]) -> dict[str, Any]:
    """preprocessor_config.json of the published checkpoints, with this tower's patch sizes."""
    return {
        "size": {"longest_edge": QWEN3_VL.max_pixels, "shortest_edge": QWEN3_VL.min_pixels},
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "image_mean": list(QWEN3_VL.image_mean),
        "image_std": list(QWEN3_VL.image_std),
        "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast",
    }


def vl_presets() -> list[tuple[str, str, dict[str, Any]]]:
    """(name, Hugging Face repo, config.json) of the published Qwen3-VL sizes, smallest first."""
    hub = "Qwen/Qwen3-VL-"
    moe_tower = dict(model_type="qwen3_vl_moe")
    return [
        (
            "qwen3-vl-2b",
            hub + "2B-Instruct",
            vl_config(
                text_config(2048, 6144, 28, 16, 8, tie_word_embeddings=True, _insert_before="use_cache"),
                vision_config(SMALL_TOWER, 2048),
                tied=True,
            ),
        ),
        (
            "qwen3-vl-4b",
            hub + "4B-Instruct",
            vl_config(
                text_config(2560, 9728, 36, 32, 8, tie_word_embeddings=True, _insert_before="use_cache"),
                vision_config(SMALL_TOWER, 2560),
                tied=True,
            ),
        ),
        (
            "qwen3-vl-8b",
            hub + "8B-Instruct",
            vl_config(text_config(4096, 12288, 36, 32, 8), vision_config(LARGE_TOWER, 4096), tied=False),
        ),
        (
            "qwen3-vl-32b",
            hub + "32B-Instruct",
            vl_config(text_config(5120, 25600, 64, 64, 8), vision_config(LARGE_TOWER, 5120), tied=False),
        ),
        (
            "qwen3-vl-30b-a3b",
            hub + "30B-A3B-Instruct",
            vl_config(
                moe_text_config(text_config(2048, 6144, 48, 32, 4), 768, 128, 8),
                vision_config(LARGE_TOWER, 2048, **moe_tower),
                tied=False,
            ),
        ),
        (
            "qwen3-vl-235b-a22b",
            hub + "235B-A22B-Instruct",
            vl_config(
                moe_text_config(text_config(4096, 12288, 94, 64, 4), 1536, 128, 8),
                vision_config(LARGE_TOWER, 4096, **moe_tower),
                tied=False,
            ),
        ),
    ]


def _changed(config: dict[str, Any], changed: dict[str, Any]) -> dict[str, Any]:
    """`config` with `changed` keys replaced; new keys only with `_insert_before` naming where."""
    changed = dict(changed)
    before = changed.pop("_insert_before", None)
    unknown = [key for key in changed if key not in config]
    if unknown and before is None:  # a typo here would silently add a key no published config has
        raise KeyError(f"not a key of this config: {unknown}")
    out: dict[str, Any] = {}
    for key, value in config.items():
        if key == before:
            out |= {k: changed[k] for k in unknown}
        out[key] = changed.get(key, value)
    return out
