"""Named model presets for `qcompile synth`: Hugging Face config.json dicts, as data.

The real presets reproduce the config.json files Qwen published for each Qwen3 checkpoint
(same keys, same values, key order as in the files); the `tiny*` presets keep the real
architecture at test size, with a small vocabulary laid out the way the synthetic tokenizer lays
out its own (see `qcompile.synth.tokenizer`): trained tokens first, then Qwen's special tokens.

Presets are frozen: `Preset.config()` returns a fresh dict each call, so callers may edit theirs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from qcompile.errors import QCompileError
from qcompile.synth import vl_presets as vl

QWEN_BOS_ID = 151643  # <|endoftext|>
QWEN_EOS_ID = 151645  # <|im_end|>
QWEN_VOCAB_SIZE = 151936
TINY_TRAINED_VOCAB = 512  # byte-level BPE tokens the tiny presets' tokenizer learns
TINY_SPECIALS = 26  # Qwen3's added tokens, <|endoftext|> ... </think>


class UnknownPresetError(QCompileError):
    """A preset name that is not in the registry."""


@dataclass(frozen=True)
class Preset:
    """One named config.json. `source` says where the values come from (a Hugging Face repo id)."""

    name: str
    source: str
    config_json: str  # the config as canonical JSON text, so the registry cannot be mutated
    preprocessor_json: str | None = None  # a Qwen3-VL preset's preprocessor_config.json

    @classmethod
    def of(
        cls, name: str, source: str, config: Mapping[str, Any], preprocessor: Mapping[str, Any] | None = None
    ) -> Preset:
        return cls(name, source, json.dumps(config), None if preprocessor is None else json.dumps(preprocessor))

    def config(self) -> dict[str, Any]:
        """A fresh copy of the config.json dict."""
        return json.loads(self.config_json)

    def preprocessor(self) -> dict[str, Any] | None:
        """A fresh copy of the preprocessor_config.json dict (None: not a vision model)."""
        return None if self.preprocessor_json is None else json.loads(self.preprocessor_json)


def _dense(hidden: int, inter: int, layers: int, heads: int, kv: int, tied: bool, **changed: Any) -> dict[str, Any]:
    """A Qwen3 dense config.json, keys in the published files' order."""
    config: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": QWEN_BOS_ID,
        "eos_token_id": QWEN_EOS_ID,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": QWEN_VOCAB_SIZE,
    }
    return _changed(config, changed)


def _moe(hidden: int, inter: int, moe_inter: int, layers: int, heads: int, kv: int, **changed: Any) -> dict[str, Any]:
    """A Qwen3-MoE config.json (128 experts, top 8, every layer sparse), keys in published order."""
    config: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": QWEN_BOS_ID,
        "decoder_sparse_step": 1,
        "eos_token_id": QWEN_EOS_ID,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": moe_inter,
        "norm_topk_prob": True,
        "num_attention_heads": heads,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": QWEN_VOCAB_SIZE,
    }
    return _changed(config, changed)


def _changed(config: dict[str, Any], changed: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(changed) - set(config))
    if unknown:  # a typo here would silently add a key no published config has
        raise KeyError(f"not a key of this config: {unknown}")
    return {**config, **changed}


def _tiny(**changed: Any) -> dict[str, Any]:
    """The real dense layout at test size: 2 layers, 4 heads of 16, a 544-token vocabulary."""
    specials = TINY_TRAINED_VOCAB
    config = _dense(
        hidden=64,
        inter=128,
        layers=2,
        heads=4,
        kv=2,
        tied=False,
        head_dim=16,
        bos_token_id=specials,
        eos_token_id=specials + 2,
        max_position_embeddings=4096,
        vocab_size=_round_up(specials + TINY_SPECIALS, 32),  # padded like Qwen's 151936 rows
    )
    return _changed(config, changed)


def _tiny_moe() -> dict[str, Any]:
    """Qwen3-MoE at test size: 3 layers, the middle one dense (mlp_only_layers), 8 experts, top 2."""
    specials = TINY_TRAINED_VOCAB
    return _moe(
        hidden=64,
        inter=128,
        moe_inter=32,
        layers=3,
        heads=4,
        kv=2,
        head_dim=16,
        bos_token_id=specials,
        eos_token_id=specials + 2,
        max_position_embeddings=4096,
        mlp_only_layers=[1],
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=_round_up(specials + TINY_SPECIALS, 32),
    )


def _tiny_vl(moe: bool) -> dict[str, Any]:
    """Qwen3-VL at test size (tests/qwen3_vl_checkpoints.py's shapes over the tiny vocabulary): 3 text
    layers, a 3-block tower of patch 4 with DeepStack after blocks 0 and 2; MoE: 4 experts, top 2,
    layer 1 dense, its own head."""
    specials = TINY_TRAINED_VOCAB
    text = vl.text_config(
        64,
        128,
        3,
        4,
        2,
        bos=specials,
        head_dim=16,
        max_position_embeddings=4096,
        rope_scaling={"mrope_interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default"},
        rope_theta=10000.0,
        vocab_size=_round_up(specials + TINY_SPECIALS, 32),
    )
    if moe:
        text = vl.moe_text_config(text, 32, 4, 2, mlp_only_layers=[1])
    tower = dict(depth=3, hidden_size=32, intermediate_size=48, deepstack_visual_indexes=[0, 2])
    vision = vl.vision_config(tower, 64, num_heads=2, num_position_embeddings=16, patch_size=4)
    return vl.vl_config(text, vision, tied=not moe)


# images a few tokens each: sides multiples of 8 (patch 4 x merge 2), at most 48 x 48 pixels
TINY_VL_PREPROCESSOR = {
    "size": {"longest_edge": 48 * 48, "shortest_edge": 64},
    "patch_size": 4,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _registry() -> Mapping[str, Preset]:
    hub = "Qwen/Qwen3-"
    presets = (
        Preset.of("qwen3-0.6b", hub + "0.6B", _dense(1024, 3072, 28, 16, 8, tied=True)),
        Preset.of("qwen3-1.7b", hub + "1.7B", _dense(2048, 6144, 28, 16, 8, tied=True)),
        # the published 4B file differs from its siblings in these formatting-level fields
        Preset.of(
            "qwen3-4b",
            hub + "4B",
            _dense(
                2560,
                9728,
                36,
                32,
                8,
                tied=True,
                attention_dropout=0,
                transformers_version="4.51.2",
                use_cache=False,
            ),
        ),
        Preset.of("qwen3-8b", hub + "8B", _dense(4096, 12288, 36, 32, 8, tied=False)),
        Preset.of("qwen3-14b", hub + "14B", _dense(5120, 17408, 40, 40, 8, tied=False)),
        Preset.of("qwen3-32b", hub + "32B", _dense(5120, 25600, 64, 64, 8, tied=False)),
        Preset.of("qwen3-30b-a3b", hub + "30B-A3B", _moe(2048, 6144, 768, 48, 32, 4)),
        Preset.of("qwen3-235b-a22b", hub + "235B-A22B", _moe(4096, 12288, 1536, 94, 64, 4)),
        *(
            Preset.of(name, repo, config, vl.published_preprocessor(config["vision_config"]))
            for name, repo, config in vl.vl_presets()
        ),
        Preset.of("tiny", "test", _tiny()),
        Preset.of("tiny-tied", "test", _tiny(tie_word_embeddings=True)),
        Preset.of("tiny-moe", "test", _tiny_moe()),
        Preset.of("tiny-vl", "test", _tiny_vl(moe=False), TINY_VL_PREPROCESSOR),
        Preset.of("tiny-vl-moe", "test", _tiny_vl(moe=True), TINY_VL_PREPROCESSOR),
        # non-power-of-two everything, and a vocabulary with no padding rows
        Preset.of(
            "tiny-odd",
            "test",
            _tiny(
                hidden_size=96,
                intermediate_size=72,
                num_attention_heads=6,
                num_key_value_heads=3,
                vocab_size=TINY_TRAINED_VOCAB + TINY_SPECIALS,
            ),
        ),
    )
    return MappingProxyType({p.name: p for p in presets})


def preset_names() -> list[str]:
    """Every preset name, real models first (smallest to largest), then the test presets."""
    return list(_registry())


def get_preset(name: str) -> Preset:
    """The preset called `name`; an unknown name is an error listing the known ones."""
    registry = _registry()
    try:
        return registry[name]
    except KeyError:
        raise UnknownPresetError(f"unknown preset {name!r}; choose one of: {', '.join(registry)}") from None
