"""config.json -> ModelSpec: the supported architectures and errors that name the key."""

import pytest

from qcompile.errors import CheckpointError
from qcompile.source.spec import ModelSpec


def _dense(**over):
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    config.update(over)
    return config


def test_dense_and_roundtrip():
    spec = ModelSpec.from_config(_dense())
    assert spec.q_size == 64 and spec.kv_size == 32 and not spec.is_moe
    assert ModelSpec.from_dict(spec.to_dict()) == spec


def test_v5_rope_parameters_and_moe_aliases():
    config = _dense(
        architectures=["Qwen3MoeForCausalLM"],
        num_local_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[1],
        decoder_sparse_step=1,
        norm_topk_prob=True,
    )
    del config["rope_theta"]
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}
    spec = ModelSpec.from_config(config)
    assert spec.rope_theta == 5000.0 and spec.moe.num_experts == 8
    assert spec.is_sparse_layer(0) and not spec.is_sparse_layer(1)
    assert ModelSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    "over, message",
    [
        (
            {"architectures": ["LlamaForCausalLM"]},
            "'LlamaForCausalLM' is not supported; supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM",
        ),
        ({"hidden_size": -1}, "'hidden_size' must be a positive integer"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"rms_norm_eps": "tiny"}, "'rms_norm_eps' must be a positive number"),
        ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
        ({"torch_dtype": "int8"}, "dtype 'int8' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_errors_name_the_key(over, message):
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelSpec.from_config(_dense(**over), source="ckpt/config.json")


def test_missing_key():
    config = _dense()
    del config["vocab_size"]
    with pytest.raises(CheckpointError, match="ckpt/config.json: required key 'vocab_size' is missing"):
        ModelSpec.from_config(config, source="ckpt/config.json")
