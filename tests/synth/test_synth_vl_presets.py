"""Qwen3-VL presets: the published configs parse, their parameter counts are the published totals,
token ids are Qwen's and the synthetic tokenizer's, and the checkpoint's tensors are transformers'."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

from qcompile.errors import ArtifactError
from qcompile.source.spec import ModelSpec
from qcompile.synth import get_preset, plan_checkpoint
from qcompile.synth.tokenizer import TokenizerLayout

REAL_VL = ["qwen3-vl-2b", "qwen3-vl-4b", "qwen3-vl-8b", "qwen3-vl-32b", "qwen3-vl-30b-a3b", "qwen3-vl-235b-a22b"]
# Totals of the published safetensors (text + tower), from model reports listing every stored tensor
# of Qwen3-VL-8B-Instruct, -30B-A3B-Instruct and -235B-A22B-Instruct (qcompile/synth/vl_presets.py);
# tensor counts from the same reports. No published total was found for 2B, 4B and 32B.
PUBLISHED = {
    "qwen3-vl-8b": (8_767_123_696, 750),
    "qwen3-vl-30b-a3b": (31_070_754_032, 882),
    "qwen3-vl-235b-a22b": (235_670_022_896, 1388),
}
QWEN_VISION_IDS = dict(
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653
)


@pytest.mark.parametrize("name", REAL_VL + ["tiny-vl", "tiny-vl-moe"])
def test_config_parses_into_model_spec_and_transformers(name):
    config = get_preset(name).config()
    spec = ModelSpec.from_config(config)
    text = config["text_config"]
    assert spec.architecture == config["architectures"][0]
    assert (spec.hidden_size, spec.num_hidden_layers) == (text["hidden_size"], text["num_hidden_layers"])
    assert spec.vision is not None and spec.vision.deepstack_layers == 3 - (name.startswith("tiny"))
    assert spec.vision.image_token_id == config["image_token_id"]
    assert spec.tie_word_embeddings == config["tie_word_embeddings"]
    assert (spec.moe is not None) == ("Moe" in spec.architecture)
    layout = TokenizerLayout.from_config(config)  # vision ids agree with the tokenizer's added tokens
    assert layout.token_id("<|image_pad|>") == config["image_token_id"]
    hf = (Qwen3VLMoeConfig if spec.moe else Qwen3VLConfig)(**config)
    assert hf.vision_config.out_hidden_size == hf.text_config.hidden_size == spec.hidden_size


@pytest.mark.parametrize("name", REAL_VL)
def test_real_presets_keep_published_values(name):
    config = get_preset(name).config()
    text, vision = config["text_config"], config["vision_config"]
    assert {k: config[k] for k in QWEN_VISION_IDS} == QWEN_VISION_IDS
    assert (text["bos_token_id"], text["eos_token_id"], text["vocab_size"]) == (151643, 151645, 151936)
    assert text["rope_scaling"] == {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"}
    assert (text["rope_theta"], text["max_position_embeddings"], text["head_dim"]) == (5000000, 262144, 128)
    assert config["tie_word_embeddings"] is (name in ("qwen3-vl-2b", "qwen3-vl-4b"))
    assert (vision["patch_size"], vision["spatial_merge_size"], vision["num_position_embeddings"]) == (16, 2, 2304)
    assert vision["out_hidden_size"] == text["hidden_size"]
    small = name in ("qwen3-vl-2b", "qwen3-vl-4b")
    assert vision["deepstack_visual_indexes"] == ([5, 11, 17] if small else [8, 16, 24])
    assert (vision["depth"], vision["hidden_size"]) == ((24, 1024) if small else (27, 1152))
    if "a" in name.split("-")[-1]:
        assert (text["num_experts"], text["num_experts_per_tok"], text["mlp_only_layers"]) == (128, 8, [])
    preprocessor = get_preset(name).preprocessor()
    assert preprocessor["size"] == {"longest_edge": 16777216, "shortest_edge": 65536}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_are_the_published_totals(name):
    plan = plan_checkpoint(name)
    total, tensors = PUBLISHED[name]
    print(f"{name}: {plan.parameters:,} parameters (published {total:,})")
    assert plan.parameters == pytest.approx(total, rel=0.01)
    assert plan.parameters == total  # exactly, in fact: same tensors, same shapes
    assert sum(len(s.tensors) for s in plan.shards) == tensors
    assert plan.weight_bytes == 2 * plan.parameters


def test_moe_checkpoint_stacks_experts_in_transformers_layout():
    plan = plan_checkpoint("qwen3-vl-30b-a3b")
    shapes = {t.name: t.shape for s in plan.shards for t in s.tensors}
    assert shapes["model.language_model.layers.0.mlp.experts.gate_up_proj"] == (128, 2 * 768, 2048)
    assert shapes["model.language_model.layers.47.mlp.experts.down_proj"] == (128, 2048, 768)
    assert shapes["model.visual.patch_embed.proj.weight"] == (1152, 3, 2, 16, 16)
    assert not any(".experts.0." in name or name.startswith("model.layers.") for name in shapes)


def test_tokenizer_refuses_vision_ids_off_its_layout():
    config = get_preset("tiny-vl").config()
    config["image_token_id"] += 1
    with pytest.raises(ArtifactError, match="image_token_id"):
        TokenizerLayout.from_config(config)


def test_checkpoint_loads_into_transformers(tmp_path, rng):
    """A tiny-vl-moe checkpoint is what transformers saves: from_pretrained finds every tensor."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from qcompile.synth import write_checkpoint

    seed = rng.randrange(1 << 30)
    print(f"synth seed {seed}")
    write_checkpoint("tiny-vl-moe", tmp_path / "ckpt", seed=seed)
    model, info = Qwen3VLMoeForConditionalGeneration.from_pretrained(
        tmp_path / "ckpt", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    norm = model.model.visual.blocks[0].norm1.weight
    assert 0.5 < float(norm.mean()) < 1.5  # the tower's LayerNorm gains are drawn around 1
