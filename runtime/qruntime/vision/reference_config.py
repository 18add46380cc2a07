"""A Qwen3-VL checkpoint's config.json, as the reference forward (reference.py) reads it.

Two model types, as transformers 5.17 names them: `qwen3_vl` (Qwen3VLForConditionalGeneration, a
dense text model) and `qwen3_vl_moe` (Qwen3VLMoeForConditionalGeneration, sparse MoE blocks in the
layers decoder_sparse_step and mlp_only_layers pick). The text model's sizes are required; keys
that change nothing in a forward pass (init scale, cache and token settings) are passed over; any
other key is refused by name rather than silently ignored. Whether lm_head shares the token
embeddings is the top-level tie_word_embeddings (text_config's copy is not what transformers ties by).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from qruntime.shown import shown
from qruntime.vision.positions import MRopeConfig, VisionTokenConfig
from qruntime.vision.tower_config import VisionTowerConfig

_TEXT_TYPES = {"qwen3_vl": "qwen3_vl_text", "qwen3_vl_moe": "qwen3_vl_moe_text"}
_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
_MOE_SIZES = ("num_experts_per_tok", "moe_intermediate_size")
# text_config keys a forward pass does not read (rope keys are MRopeConfig's).
_TEXT_PASSED_OVER = frozenset(
    {
        "model_type",
        "attention_dropout",
        "max_position_embeddings",
        "use_cache",
        "initializer_range",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "_name_or_path",
        "router_aux_loss_coef",
        "output_router_logits",
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
    }
)
_TEXT_READ = frozenset(
    {
        *_SIZES,
        "intermediate_size",
        "rms_norm_eps",
        "attention_bias",
        "hidden_act",
        "sliding_window",
        "use_sliding_window",
    }
)
_MOE_READ = frozenset(
    {*_MOE_SIZES, "num_experts", "num_local_experts", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"}
)


def _positive(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"text_config: {key} must be a positive integer, got {shown(value)}")
    return value


@dataclass(frozen=True)
class MoeConfig:
    """The sparse MoE blocks: top-k of num_experts by softmax over the router's logits, the chosen
    k weights renormalized to sum to 1 (transformers 5.17 always renormalizes for Qwen3-VL MoE)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class TextConfig:
    """The text decoder's shape (a Qwen3 decoder: q/k norm, GQA, SwiGLU or sparse MoE MLPs)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int | None  # the dense MLPs' (None: a MoE model without dense layers)
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    moe: MoeConfig | None = None

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a sparse MoE block (transformers' Qwen3VLMoeTextDecoderLayer rule)."""
        m = self.moe
        return m is not None and layer not in m.mlp_only_layers and (layer + 1) % m.decoder_sparse_step == 0

    @classmethod
    def from_dict(cls, text_config: Mapping[str, Any], *, moe: bool) -> TextConfig:
        """From config.json's text_config; `moe` for a qwen3_vl_moe model. Errors name the key."""
        if not isinstance(text_config, Mapping):
            raise ValueError(f"text_config must be a dict, got {shown(text_config)}")
        known = _TEXT_PASSED_OVER | _TEXT_READ | (_MOE_READ if moe else frozenset())
        for key in text_config:
            if key not in known:
                raise ValueError(f"text_config: unknown key {shown(key)} (this reference does not read it)")
        for key in _SIZES:
            if text_config.get(key) is None:
                raise ValueError(f"text_config: {key} is missing")
        sizes = {key: _positive(key, text_config[key]) for key in _SIZES}
        if sizes["num_attention_heads"] % sizes["num_key_value_heads"]:
            raise ValueError(
                f"text_config: num_attention_heads ({sizes['num_attention_heads']}) is not a multiple of "
                f"num_key_value_heads ({sizes['num_key_value_heads']})"
            )
        if text_config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"text_config: hidden_act {shown(text_config['hidden_act'])} is not supported (silu)")
        if text_config.get("sliding_window") is not None or text_config.get("use_sliding_window", False):
            raise ValueError("text_config: sliding_window is not supported (Qwen3-VL attends to the whole sequence)")
        eps = text_config.get("rms_norm_eps", 1e-6)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ValueError(f"text_config: rms_norm_eps must be a number in (0, 1), got {shown(eps)}")
        bias = text_config.get("attention_bias", False)
        if not isinstance(bias, bool):
            raise ValueError(f"text_config: attention_bias must be true or false, got {shown(bias)}")
        moe_config = _moe(text_config, sizes["num_hidden_layers"]) if moe else None
        config = cls(**sizes, intermediate_size=None, rms_norm_eps=float(eps), attention_bias=bias, moe=moe_config)
        dense_layers = not all(config.is_sparse(i) for i in range(config.num_hidden_layers))
        if text_config.get("intermediate_size") is not None or dense_layers:
            if text_config.get("intermediate_size") is None:
                raise ValueError("text_config: intermediate_size is missing (the dense MLP layers need it)")
            intermediate = _positive("intermediate_size", text_config["intermediate_size"])
            config = replace(config, intermediate_size=intermediate)
        return config


def _moe(text_config: Mapping[str, Any], layers: int) -> MoeConfig:
    experts = text_config.get("num_experts", text_config.get("num_local_experts"))
    both = "num_experts" in text_config and "num_local_experts" in text_config
    if both and text_config["num_experts"] != text_config["num_local_experts"]:
        raise ValueError("text_config: num_experts and num_local_experts differ")
    if experts is None:
        raise ValueError("text_config: num_experts is missing")
    for key in _MOE_SIZES:
        if text_config.get(key) is None:
            raise ValueError(f"text_config: {key} is missing")
    values = {key: _positive(key, text_config[key]) for key in _MOE_SIZES}
    values["num_experts"] = _positive("num_experts", experts)
    if values["num_experts_per_tok"] > values["num_experts"]:
        raise ValueError(
            f"text_config: num_experts_per_tok ({values['num_experts_per_tok']}) exceeds num_experts "
            f"({values['num_experts']})"
        )
    if text_config.get("norm_topk_prob", True) is not True:
        raise ValueError(
            f"text_config: norm_topk_prob {shown(text_config['norm_topk_prob'])} is not supported: transformers "
            "5.17 renormalizes the top-k weights of Qwen3-VL MoE whatever it says; refused rather than guessed"
        )
    step = _positive("decoder_sparse_step", text_config.get("decoder_sparse_step", 1))
    only = text_config.get("mlp_only_layers") or []
    if not isinstance(only, Sequence) or isinstance(only, str):
        raise ValueError(f"text_config: mlp_only_layers must be a list, got {shown(only)}")
    for layer in only:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers:
            raise ValueError(f"text_config: mlp_only_layers entry {shown(layer)} is not a layer index")
    return MoeConfig(**values, decoder_sparse_step=step, mlp_only_layers=tuple(only))


@dataclass(frozen=True)
class ReferenceConfig:
    """Everything a Qwen3-VL forward reads from config.json."""

    moe: bool  # qwen3_vl_moe
    text: TextConfig
    rope: MRopeConfig
    tokens: VisionTokenConfig
    tower: VisionTowerConfig
    tie_word_embeddings: bool

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ReferenceConfig:
        if not isinstance(config, Mapping):
            raise ValueError(f"config.json must hold a dict, got {shown(config)}")
        model_type = config.get("model_type")
        if model_type not in _TEXT_TYPES:
            raise ValueError(f"config.json: model_type {shown(model_type)} is not qwen3_vl or qwen3_vl_moe")
        text_config = config.get("text_config")
        vision_config = config.get("vision_config")
        for key, value in (("text_config", text_config), ("vision_config", vision_config)):
            if not isinstance(value, Mapping):
                raise ValueError(f"config.json: {key} must be a dict, got {shown(value)}")
        text_type = text_config.get("model_type", _TEXT_TYPES[model_type])
        if text_type != _TEXT_TYPES[model_type]:
            raise ValueError(f"text_config: model_type {shown(text_type)} is not {_TEXT_TYPES[model_type]}")
        moe = model_type == "qwen3_vl_moe"
        text = TextConfig.from_dict(text_config, moe=moe)
        rope = MRopeConfig.from_dict(text_config)
        tower = VisionTowerConfig.from_dict(vision_config)
        if tower.out_hidden_size != text.hidden_size:
            raise ValueError(
                f"vision_config: out_hidden_size ({tower.out_hidden_size}) is not text_config's hidden_size "
                f"({text.hidden_size})"
            )
        tokens = VisionTokenConfig.from_dict(config)
        for key in ("image_token_id", "video_token_id", "vision_start_token_id"):
            value = getattr(tokens, key)
            if value is not None and value >= text.vocab_size:
                raise ValueError(f"config.json: {key} {value} is outside the vocabulary ({text.vocab_size})")
        tie = config.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise ValueError(f"config.json: tie_word_embeddings must be true or false, got {shown(tie)}")
        return cls(moe=moe, text=text, rope=rope, tokens=tokens, tower=tower, tie_word_embeddings=tie)
