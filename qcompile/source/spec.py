"""ModelSpec: the frozen description of a Qwen3 model, read from a Hugging Face config.json."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from qruntime import bounded_json
from qruntime.shown import shown

from qcompile.errors import CheckpointError
from qcompile.source.qwen3_vl_spec import VL_ARCHITECTURES, vl_fields

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", *VL_ARCHITECTURES)
_DTYPES = ("bfloat16", "float16", "float32")
# Every size in config.json is at most this (int32: token ids, positions and ONNX shapes); the sizes
# a tensor shows (qcompile.source.model.check_sizes) are then held to the checkpoint's tensors.
MAX_SIZE = (1 << 31) - 1
MAX_CONFIG_BYTES = 16 << 20  # a real config.json is a few kB


@dataclass(frozen=True)
class MoESpec:
    """The sparse-MLP fields of Qwen3-MoE."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    @cached_property
    def dense_layers(self) -> frozenset[int]:
        """mlp_only_layers as a set: is_sparse_layer runs once per layer, and both may number thousands."""
        return frozenset(self.mlp_only_layers)


@dataclass(frozen=True)
class VisionSpec:
    """The Qwen3-VL parts of a model beside its Qwen3 text decoder (docs/vision.md, "Artifacts"): the
    interleaved multimodal RoPE, the token ids that mark images, how many decoder layers take a
    DeepStack feature, and the vision tower's config (config.json's vision_config as canonical JSON,
    which qruntime.vision.VisionTowerConfig.from_dict reads)."""

    mrope_section: tuple[int, int, int]  # rotary frequencies per axis (t, h, w); sum = head_dim / 2
    image_token_id: int
    video_token_id: int | None
    vision_start_token_id: int | None
    spatial_merge_size: int
    deepstack_layers: int  # decoder layers 0 .. n-1 each add one DeepStack feature to the image rows
    tower_config: str  # vision_config, canonical JSON (sorted keys)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VisionSpec:
        return cls(**{**data, "mrope_section": tuple(data["mrope_section"])})


@dataclass(frozen=True)
class ModelSpec:
    """Everything about the model's shapes that the compiler and runtime need."""

    architecture: str
    dtype: str  # torch dtype name of the checkpoint's weights: bfloat16 | float16 | float32
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    moe: MoESpec | None = None
    vision: VisionSpec | None = None  # Qwen3-VL: the text decoder's M-RoPE, image tokens, DeepStack, tower

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a sparse (MoE) MLP, by Qwen3-MoE's own rule."""
        if self.moe is None or layer in self.moe.dense_layers:
            return False
        return (layer + 1) % self.moe.decoder_sparse_step == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        moe, vision = data.get("moe"), data.get("vision")
        fields = {k: v for k, v in data.items() if k not in ("moe", "vision")}
        if moe is not None:
            moe = MoESpec(**{**moe, "mlp_only_layers": tuple(moe["mlp_only_layers"])})
        return cls(**fields, moe=moe, vision=None if vision is None else VisionSpec.from_dict(vision))

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str = "config.json") -> ModelSpec:
        """Validate a Hugging Face config dict into a ModelSpec; errors name the key at fault."""
        reader = _ConfigReader(config, source)
        archs = config.get("architectures")
        if not isinstance(archs, list) or len(archs) != 1:
            raise CheckpointError(
                f"{source}: 'architectures' must list exactly one architecture, got {shown(archs)}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"{source}: architecture {shown(arch)} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch in VL_ARCHITECTURES:
            return cls._from_vl_config(config, arch, source)
        if config.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{source}: hidden_act {shown(config['hidden_act'])} is not supported (only 'silu')")
        if config.get("attention_bias", False):
            raise CheckpointError(f"{source}: attention_bias=true is not supported by Qwen3 kernels")
        if config.get("use_sliding_window", False):
            raise CheckpointError(f"{source}: use_sliding_window=true is not supported")
        rope_theta, rope_type = reader.rope()
        if rope_type != "default":
            raise CheckpointError(
                f"{source}: rope type {shown(rope_type)} is not supported yet (only 'default'); "
                "remove 'rope_scaling' to compile with plain RoPE"
            )

        heads = reader.positive_int("num_attention_heads")
        hidden = reader.positive_int("hidden_size")
        if config.get("head_dim") is None and hidden % heads:
            raise CheckpointError(
                f"{source}: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}) "
                "and 'head_dim' is not given; set head_dim"
            )
        head_dim = reader.positive_int("head_dim", default=hidden // heads)
        kv_heads = reader.positive_int("num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise CheckpointError(
                f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        layers = reader.positive_int("num_hidden_layers")
        moe = None
        if arch == "Qwen3MoeForCausalLM":
            experts = reader.positive_int("num_experts", alias="num_local_experts")
            top_k = reader.positive_int("num_experts_per_tok")
            if top_k > experts:
                raise CheckpointError(f"{source}: num_experts_per_tok ({top_k}) exceeds num_experts ({experts})")
            mlp_only = config.get("mlp_only_layers") or []
            if not isinstance(mlp_only, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in mlp_only
            ):
                raise CheckpointError(
                    f"{source}: 'mlp_only_layers' must list layer indices below {layers}, got {shown(mlp_only)}"
                )
            moe = MoESpec(
                num_experts=experts,
                num_experts_per_tok=top_k,
                moe_intermediate_size=reader.positive_int("moe_intermediate_size"),
                norm_topk_prob=reader.boolean("norm_topk_prob", default=False),
                decoder_sparse_step=reader.positive_int("decoder_sparse_step", default=1),
                mlp_only_layers=tuple(sorted(set(mlp_only))),
            )
        return cls(
            architecture=arch,
            dtype=reader.dtype(),
            vocab_size=reader.positive_int("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=reader.positive_int("intermediate_size"),
            rms_norm_eps=reader.positive_float("rms_norm_eps"),
            rope_theta=rope_theta,
            max_position_embeddings=reader.positive_int("max_position_embeddings"),
            tie_word_embeddings=reader.boolean("tie_word_embeddings", default=False),
            moe=moe,
        )

    @classmethod
    def _from_vl_config(cls, config: dict[str, Any], arch: str, source: str) -> ModelSpec:
        """Qwen3VLForConditionalGeneration / Qwen3VLMoeForConditionalGeneration: text_config + vision_config."""
        fields = vl_fields(config, arch, source)
        return cls.from_dict(_vl_sizes_checked(fields, config["text_config"], source))


def _vl_sizes_checked(fields: dict[str, Any], text: dict[str, Any], source: str) -> dict[str, Any]:
    """A Qwen3-VL spec's fields (qwen3_vl_spec.vl_fields) with text_config's sizes held to MAX_SIZE and
    the dtype to the supported ones, as a Qwen3 config's are."""
    reader = _ConfigReader(text, f"{source} text_config")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        reader.positive_int(key)
    sizes = {key: reader.positive_int(key) for key in ("intermediate_size", "max_position_embeddings", "head_dim")}
    if fields["moe"] is not None:
        for key in ("num_experts_per_tok", "moe_intermediate_size"):
            reader.positive_int(key)
        reader.positive_int("num_experts", alias="num_local_experts")
    dtype = _ConfigReader({"dtype": fields["dtype"]}, source).dtype()
    return {**fields, **sizes, "dtype": dtype}


def load_config(path: Path) -> dict[str, Any]:
    """Read a config.json, turning every way it can be broken into a CheckpointError: bounded in
    size (MAX_CONFIG_BYTES) and nesting (qruntime.bounded_json)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: not found; a Hugging Face checkpoint needs a config.json")
    return read_json(path, MAX_CONFIG_BYTES)


def read_json(path: Path, max_bytes: int) -> Any:
    """A JSON object from a checkpoint's file, at most `max_bytes` and nested within bounded_json's
    depth; every way it can be broken (too big, not UTF-8, malformed, too deep, a lone surrogate,
    an integer too long to convert, not an object) is a CheckpointError naming the file."""
    try:
        with open(path, "rb") as handle:  # read(n) allocates n bytes first: ask for what the file holds
            raw = handle.read(min(os.fstat(handle.fileno()).st_size, max_bytes) + 1)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc})") from exc
    if len(raw) > max_bytes:
        raise CheckpointError(f"{path}: larger than {max_bytes:,} bytes; refusing to parse it")
    try:
        data = bounded_json.loads(raw, what=str(path))
    except bounded_json.JSONLimitError as exc:  # its message names the file and the place
        raise CheckpointError(str(exc)) from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer past Python's 4300 digits
        raise CheckpointError(f"{path}: malformed JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


class _ConfigReader:
    """Typed access to config keys; every failure names the key and the file."""

    def __init__(self, config: dict[str, Any], source: str) -> None:
        self.config = config
        self.source = source

    def _get(self, key: str, default: Any, alias: str | None) -> Any:
        if key in self.config:
            return self.config[key]
        if alias is not None and alias in self.config:
            return self.config[alias]
        if default is None:
            raise CheckpointError(f"{self.source}: required key {key!r} is missing")
        return default

    def positive_int(self, key: str, default: int | None = None, alias: str | None = None) -> int:
        value = self._get(key, default, alias)
        if value is None and default is not None:
            value = default
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_SIZE:
            raise CheckpointError(
                f"{self.source}: {key!r} must be a positive integer up to {MAX_SIZE}, got {shown(value)}"
            )
        return value

    def positive_float(self, key: str) -> float:
        value = self._get(key, None, None)
        if not _is_positive_number(value):
            raise CheckpointError(f"{self.source}: {key!r} must be a positive number (finite), got {shown(value)}")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.config.get(key, default)
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.source}: {key!r} must be true or false, got {shown(value)}")
        return value

    def dtype(self) -> str:
        value = self.config.get("dtype") or self.config.get("torch_dtype") or "bfloat16"
        if not isinstance(value, str) or value not in _DTYPES:
            raise CheckpointError(
                f"{self.source}: dtype {shown(value)} is not supported; expected one of {', '.join(_DTYPES)}"
            )
        return value

    def rope(self) -> tuple[float, str]:
        """(theta, rope type) from either the v5 'rope_parameters' or the classic keys."""
        params = self.config.get("rope_parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise CheckpointError(f"{self.source}: 'rope_parameters' must be an object")
            theta = params.get("rope_theta", self.config.get("rope_theta"))
            rope_type = params.get("rope_type", "default")
        else:
            theta = self.config.get("rope_theta", 10000.0)
            scaling = self.config.get("rope_scaling")
            rope_type = "default"
            if scaling is not None:
                if not isinstance(scaling, dict):
                    raise CheckpointError(f"{self.source}: 'rope_scaling' must be an object or null")
                rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if not _is_positive_number(theta):
            raise CheckpointError(f"{self.source}: 'rope_theta' must be a positive number (finite), got {shown(theta)}")
        return float(theta), rope_type if isinstance(rope_type, str) else shown(rope_type)


def _is_positive_number(value: Any) -> bool:
    """A JSON number > 0 that is a finite float (json reads NaN / Infinity; 10**400 overflows float)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False
