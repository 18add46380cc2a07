"""The preset registry: every config parses, real sizes match the published ones, nothing mutates."""

from __future__ import annotations

import pytest

from qcompile.errors import QCompileError
from qcompile.source.spec import ModelSpec
from qcompile.synth import UnknownPresetError, get_preset, plan_checkpoint, preset_names
from qcompile.synth.tokenizer import TokenizerLayout

REAL = [
    "qwen3-0.6b",
    "qwen3-1.7b",
    "qwen3-4b",
    "qwen3-8b",
    "qwen3-14b",
    "qwen3-32b",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
]
TINY = ["tiny", "tiny-tied", "tiny-moe", "tiny-odd"]

# Published totals (model cards; embeddings counted once when tied), in billions.
PUBLISHED_BILLIONS = {
    "qwen3-0.6b": 0.596,
    "qwen3-1.7b": 1.72,
    "qwen3-4b": 4.02,
    "qwen3-8b": 8.19,
    "qwen3-14b": 14.77,
    "qwen3-32b": 32.76,
    "qwen3-30b-a3b": 30.53,
    "qwen3-235b-a22b": 235.09,
}


REAL_VL = ["qwen3-vl-2b", "qwen3-vl-4b", "qwen3-vl-8b", "qwen3-vl-32b", "qwen3-vl-30b-a3b", "qwen3-vl-235b-a22b"]


def test_registry_lists_real_then_tiny_presets():
    tiny = ["tiny", "tiny-tied", "tiny-moe", "tiny-vl", "tiny-vl-moe", "tiny-odd"]
    assert preset_names() == REAL + REAL_VL + tiny  # Qwen3-VL's: tests/synth/test_synth_vl_presets.py


@pytest.mark.parametrize("name", REAL + TINY)
def test_config_parses_into_model_spec(name):
    config = get_preset(name).config()
    spec = ModelSpec.from_config(config)
    assert spec.architecture == config["architectures"][0]
    assert spec.dtype == "bfloat16"
    assert spec.tie_word_embeddings == config["tie_word_embeddings"]
    TokenizerLayout.from_config(config)  # bos/eos/vocab_size agree with the tokenizer layout


@pytest.mark.parametrize("name", REAL)
def test_real_presets_keep_published_keys(name):
    config = get_preset(name).config()
    assert config["head_dim"] == 128
    assert config["vocab_size"] == 151936
    assert (config["bos_token_id"], config["eos_token_id"]) == (151643, 151645)
    assert config["rope_theta"] == 1000000
    assert config["rope_scaling"] is None
    assert config["max_position_embeddings"] == 40960
    assert config["use_sliding_window"] is False and config["sliding_window"] is None
    assert config["max_window_layers"] == config["num_hidden_layers"]
    assert config["tie_word_embeddings"] is (name in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"))
    assert config["torch_dtype"] == "bfloat16"
    if "a" in name.split("-")[-1]:
        assert config["model_type"] == "qwen3_moe"
        assert (config["num_experts"], config["num_experts_per_tok"]) == (128, 8)
        assert config["norm_topk_prob"] is True
        assert (config["decoder_sparse_step"], config["mlp_only_layers"]) == (1, [])
    else:
        assert config["model_type"] == "qwen3"


@pytest.mark.parametrize("name", REAL)
def test_parameter_counts_match_published_sizes(name):
    plan = plan_checkpoint(name)
    assert plan.parameters / 1e9 == pytest.approx(PUBLISHED_BILLIONS[name], rel=0.005)
    assert plan.weight_bytes == 2 * plan.parameters


def test_moe_active_parameters():
    """30B-A3B activates ~3.3B per token, 235B-A22B ~22B: 8 of 128 experts, everything else dense."""
    for name, active in (("qwen3-30b-a3b", 3.35), ("qwen3-235b-a22b", 22.2)):
        spec = plan_checkpoint(name).spec
        assert spec.moe is not None
        per_expert = 3 * spec.hidden_size * spec.moe.moe_intermediate_size
        idle = (spec.moe.num_experts - spec.moe.num_experts_per_tok) * per_expert * spec.num_hidden_layers
        assert (plan_checkpoint(name).parameters - idle) / 1e9 == pytest.approx(active, rel=0.02)


def test_tiny_moe_has_one_dense_layer():
    spec = plan_checkpoint("tiny-moe").spec
    assert [spec.is_sparse_layer(i) for i in range(spec.num_hidden_layers)] == [True, False, True]


def test_configs_are_fresh_copies():
    config = get_preset("tiny").config()
    config["hidden_size"] = 1
    config["architectures"].append("X")
    assert get_preset("tiny").config()["hidden_size"] == 64
    assert get_preset("tiny").config()["architectures"] == ["Qwen3ForCausalLM"]


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(UnknownPresetError, match="qwen3-8b.*tiny-odd") as info:
        get_preset("qwen3-9b")
    assert isinstance(info.value, QCompileError)
    assert "'qwen3-9b'" in str(info.value)
