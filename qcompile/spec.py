"""ModelSpec: the frozen description of a Qwen3 model, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qcompile.errors import CheckpointError

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class MoESpec:
    """The sparse-MLP fields of Qwen3-MoE."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]


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
        if self.moe is None or layer in self.moe.mlp_only_layers:
            return False
        return (layer + 1) % self.moe.decoder_sparse_step == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        moe = data.get("moe")
        fields = {k: v for k, v in data.items() if k != "moe"}
        if moe is not None:
            moe = MoESpec(**{**moe, "mlp_only_layers": tuple(moe["mlp_only_layers"])})
        return cls(**fields, moe=moe)

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str = "config.json") -> ModelSpec:
        """Validate a Hugging Face config dict into a ModelSpec; errors name the key at fault."""
        reader = _ConfigReader(config, source)
        archs = config.get("architectures")
        if not isinstance(archs, list) or len(archs) != 1:
            raise CheckpointError(
                f"{source}: 'architectures' must list exactly one architecture, got {archs!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"{source}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{source}: hidden_act {config['hidden_act']!r} is not supported (only 'silu')")
        if config.get("attention_bias", False):
            raise CheckpointError(f"{source}: attention_bias=true is not supported by Qwen3 kernels")
        if config.get("use_sliding_window", False):
            raise CheckpointError(f"{source}: use_sliding_window=true is not supported")
        rope_theta, rope_type = reader.rope()
        if rope_type != "default":
            raise CheckpointError(
                f"{source}: rope type {rope_type!r} is not supported yet (only 'default'); "
                "remove 'rope_scaling' to compile with plain RoPE"
            )

        heads = reader.positive_int("num_attention_heads")
        hidden = reader.positive_int("hidden_size")
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
            if not isinstance(mlp_only, list) or not all(isinstance(i, int) and 0 <= i < layers for i in mlp_only):
                raise CheckpointError(f"{source}: 'mlp_only_layers' must list layer indices below {layers}")
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


def load_config(path: Path) -> dict[str, Any]:
    """Read a config.json, turning every way it can be broken into a CheckpointError."""
    if not path.is_file():
        raise CheckpointError(f"{path}: not found; a Hugging Face checkpoint needs a config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: malformed JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


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
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"{self.source}: {key!r} must be a positive integer, got {value!r}")
        return value

    def positive_float(self, key: str) -> float:
        value = self._get(key, None, None)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise CheckpointError(f"{self.source}: {key!r} must be a positive number, got {value!r}")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.config.get(key, default)
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.source}: {key!r} must be true or false, got {value!r}")
        return value

    def dtype(self) -> str:
        value = self.config.get("dtype") or self.config.get("torch_dtype") or "bfloat16"
        if value not in _DTYPES:
            raise CheckpointError(
                f"{self.source}: dtype {value!r} is not supported; expected one of {', '.join(_DTYPES)}"
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
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise CheckpointError(f"{self.source}: 'rope_theta' must be a positive number, got {theta!r}")
        return float(theta), str(rope_type)
