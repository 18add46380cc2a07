"""Recipes: YAML files validated into frozen dataclasses, with `--set key=value` overrides.

A recipe says how to compile: the quantization scheme and what it ignores, the graph passes in
order, the KV cache (dtype, layout, block size), the tensor-parallel degree and the weight shard
size. Unknown keys and bad values are errors naming the key and the file.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml
from qruntime.shown import shown
from qruntime.target import DEFAULT_TARGET, TARGETS

from qcompile.errors import RecipeError
from qcompile.io import bounded_yaml
from qcompile.recipe.ignore_list import IgnoreList


def recipe_dir() -> Path:
    """The shipped recipes: qcompile/recipe/shipped, a link to the repo's recipes/ (copied into wheels)."""
    return Path(__file__).resolve().parent / "shipped"


DEFAULT_RECIPE = "ptpc-fp8"
DEFAULT_PASSES = (
    "fuse_qkv_proj",
    "fuse_gate_up_proj",
    "fuse_moe_experts",
    "fuse_add_rmsnorm_quant",
    "fuse_allreduce_add_rmsnorm",
    "fuse_silu_mul_quant",
    "fuse_qknorm_rope_kvwrite",
)
DEFAULT_IGNORE = ("lm_head", "re:.*mlp.gate$")
# quantization.method: how a scheme's weights are made; awq searches scales on --calib text first
METHODS = MappingProxyType(
    {
        "rtn": "round to nearest",
        "awq": "activation-aware scales searched on --calib text (w4a16 only), then round to nearest",
    }
)
# quantization.awq_mappings: which of llm-compressor's AWQModifier mappings (awq_groups.py) the search
# takes; an llm-compressor recipe that spells the mappings out names the architecture they fit
AWQ_MAPPINGS = MappingProxyType(
    {
        "auto": "AWQModifier's default mappings for the checkpoint's architecture (Qwen3 or Qwen3-MoE)",
        "qwen3": "AWQModifier's Qwen3 (dense) mappings: refused for a Qwen3-MoE checkpoint",
        "qwen3-moe": "AWQModifier's Qwen3-MoE mappings: refused for a dense Qwen3 checkpoint",
    }
)
MAX_SHARD_MB = 1 << 20  # 1 TiB: larger than any model; bounds what the writer is asked to lay out


@dataclass(frozen=True)
class QuantizationRecipe:
    """Which linear layers are quantized and how; `ignore` uses llm-compressor's matching
    (an exact module name, or `re:` + a regex matched from the start of the name)."""

    scheme: str = "ptpc-fp8"
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    method: str = "rtn"  # how the weights are rounded: METHODS
    awq_mappings: str = "auto"  # method awq: AWQ_MAPPINGS

    @functools.cached_property
    def ignore_list(self) -> IgnoreList:
        """`ignore` compiled (once: validating the recipe does it), matched with bounded work."""
        return IgnoreList(self.ignore)


@dataclass(frozen=True)
class KVCacheRecipe:
    dtype: str = "bf16"
    layout: str = "nhd"
    block_size: int = 16
    calibrate: bool = False  # fp8 KV: per-layer scales from calibration text (compile --calib FILE)


# vision.scheme: a Qwen3-VL vision tower's ViT-block linears (qkv, proj, fc1, fc2); docs/vision.md, "FP8 tower"
VISION_SCHEMES = ("none", "ptpc-fp8")


@dataclass(frozen=True)
class VisionRecipe:
    """How a Qwen3-VL checkpoint's vision tower is compiled: `scheme` none keeps it in the model
    dtype; ptpc-fp8 quantizes its blocks' linears as the text model's ptpc-fp8 does (the patch
    embedding, the norms and the mergers stay in the model dtype). Ignored for a Qwen3 checkpoint."""

    scheme: str = "none"


@dataclass(frozen=True)
class Recipe:
    name: str = DEFAULT_RECIPE
    description: str = ""
    quantization: QuantizationRecipe = field(default_factory=QuantizationRecipe)
    passes: tuple[str, ...] = DEFAULT_PASSES
    kv_cache: KVCacheRecipe = field(default_factory=KVCacheRecipe)
    vision: VisionRecipe = field(default_factory=VisionRecipe)
    tp: int = 1
    max_shard_mb: int = 4096
    target: str = DEFAULT_TARGET  # the GPU family the artifact is made for (qruntime.target)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["quantization"]["ignore"] = list(self.quantization.ignore)
        if self.quantization.method == "rtn":
            del data["quantization"]["method"]  # the default: manifests read as before
        if self.quantization.awq_mappings == "auto":
            del data["quantization"]["awq_mappings"]  # the default: manifests read as before
        if self.vision == VisionRecipe():
            del data["vision"]  # the default: manifests read as before
        if self.target == DEFAULT_TARGET:
            del data["target"]  # the default: manifests read as before (the manifest's own `target` says it)
        data["passes"] = list(self.passes)
        return data

    @property
    def needs_calib(self) -> bool:
        """Whether compiling with this recipe needs calibration text (--calib)."""
        return self.kv_cache.calibrate or self.quantization.method == "awq"

    def ignores(self, module: str) -> bool:
        """Whether the linear module `module` is kept unquantized by the ignore list."""
        return self.quantization.ignore_list.matches(module)


def list_recipes() -> list[str]:
    return sorted(p.stem for p in recipe_dir().glob("*.yaml"))


def resolve_recipe_path(name_or_path: str) -> Path:
    """A shipped recipe name (`ptpc-fp8`) or a path to a YAML file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise RecipeError(f"{path}: recipe file not found")
        return path
    shipped = recipe_dir() / f"{name_or_path}.yaml"
    if not shipped.is_file():
        raise RecipeError(
            f"unknown recipe {shown(name_or_path)}: not a file and not a shipped recipe ({', '.join(list_recipes())})"
        )
    return shipped


def load_recipe(name_or_path: str = DEFAULT_RECIPE, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load a recipe (ours or an llm-compressor one), apply `key=value` overrides, validate."""
    path = resolve_recipe_path(name_or_path)
    raw = _read_yaml(path)
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe must be a YAML mapping")
    from qcompile.recipe.llm_compressor import is_llmcompressor_recipe, translate_llmcompressor_recipe

    if is_llmcompressor_recipe(raw):
        raw = translate_llmcompressor_recipe(raw, source=str(path))
    raw.setdefault("name", path.stem)
    for item in overrides:
        _apply_override(raw, item)
    return recipe_from_dict(raw, source=str(path))


def _read_yaml(path: Path) -> Any:
    """The recipe file's YAML, bounded (qcompile.io.bounded_yaml): its size checked before it is read."""
    try:
        size = path.stat().st_size
        if size > bounded_yaml.MAX_CHARS:
            raise RecipeError(f"{path}: {size:,} bytes; a recipe may be at most {bounded_yaml.MAX_CHARS:,}")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot be read as UTF-8 text ({exc})") from exc
    try:
        return bounded_yaml.loads(text, what=str(path))
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML ({_one_line(exc)})") from exc


def _one_line(exc: Exception) -> str:
    """PyYAML's multi-line error (problem, context, marks) as one line."""
    return " ".join(str(exc).split())


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise RecipeError(f"--set {shown(item)}: expected key=value, e.g. kv_cache.layout=hnd")
    try:
        parsed = bounded_yaml.loads(value, what=f"--set {shown(key)}") if value else ""
    except yaml.YAMLError as exc:
        raise RecipeError(f"--set {shown(item)}: value is not valid YAML ({_one_line(exc)})") from exc
    if key in ("passes", "quantization.ignore") and isinstance(parsed, str):
        parsed = [p.strip() for p in parsed.split(",") if p.strip()]
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"--set {shown(key)}: {shown(part)} is not a section")
        node = child
    node[parts[-1]] = parsed


def recipe_from_dict(raw: dict[str, Any], source: str = "<recipe>") -> Recipe:
    """Validate a plain dict into a Recipe; errors name the key and `source`. `kv_cache.layout: auto`
    (or no layout given) becomes the target's layout (qruntime.target: nhd for NVIDIA, AITER's
    x-packed for AMD)."""
    if isinstance(raw, dict):
        kv, target = raw.get("kv_cache", {}), raw.get("target", DEFAULT_TARGET)
        if not (isinstance(target, str) and target in TARGETS):  # first: the layout follows from it
            raise RecipeError(f"{source}: 'target' must be one of {', '.join(TARGETS)}, got {shown(target)}")
        if isinstance(kv, dict) and kv.get("layout", "auto") == "auto":
            raw = {**raw, "kv_cache": {**kv, "layout": TARGETS[target].kv_layout}}
    return _build(Recipe, raw, source, prefix="")


def _build(cls: type, raw: Any, source: str, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise RecipeError(f"{source}: {prefix.rstrip('.') or 'recipe'} must be a mapping, got {shown(raw)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in fields]  # YAML keys may be numbers, lists, ...: not sortable together
    if unknown:
        name = prefix + unknown[0] if isinstance(unknown[0], str) else unknown[0]
        raise RecipeError(
            f"{source}: unknown key {shown(name)}; known keys here: {', '.join(prefix + k for k in fields)}"
        )
    values: dict[str, Any] = {}
    for name, value in raw.items():
        key = prefix + name
        kind = fields[name].type
        if kind in ("QuantizationRecipe", "KVCacheRecipe", "VisionRecipe"):
            values[name] = _build(globals()[kind], value, source, key + ".")
        else:
            values[name] = _convert(kind, value, source, key)
    recipe = cls(**values)
    _VALIDATORS[cls](recipe, source)
    return recipe


def _convert(kind: str, value: Any, source: str, key: str) -> Any:
    if kind == "str":
        if not isinstance(value, str):
            raise RecipeError(f"{source}: {key!r} must be a string, got {shown(value)}")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise RecipeError(f"{source}: {key!r} must be true or false, got {shown(value)}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{source}: {key!r} must be an integer, got {shown(value)}")
        return value
    if kind == "tuple[str, ...]":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise RecipeError(f"{source}: {key!r} must be a list of strings, got {shown(value)}")
        return tuple(value)
    raise RecipeError(f"{source}: {key!r} has an unsupported type")  # pragma: no cover - schema bug


def _validate_quantization(q: QuantizationRecipe, source: str) -> None:
    from qcompile.quant import SCHEMES

    if q.scheme not in SCHEMES:
        raise RecipeError(f"{source}: quantization.scheme {shown(q.scheme)} is unknown; known: {', '.join(SCHEMES)}")
    if q.method not in METHODS:
        raise RecipeError(f"{source}: quantization.method {shown(q.method)} is unknown; known: {', '.join(METHODS)}")
    if q.method == "awq" and q.scheme != "w4a16":
        raise RecipeError(f"{source}: quantization.method awq needs scheme w4a16, got {shown(q.scheme)}")
    if q.awq_mappings not in AWQ_MAPPINGS:
        raise RecipeError(
            f"{source}: quantization.awq_mappings {shown(q.awq_mappings)} is unknown; known: {', '.join(AWQ_MAPPINGS)}"
        )
    if q.awq_mappings != "auto" and q.method != "awq":
        raise RecipeError(f"{source}: quantization.awq_mappings needs quantization.method awq")
    try:
        q.ignore_list  # noqa: B018 - compiles the patterns (cached on q), refusing bad or unbounded ones
    except RecipeError as exc:
        raise RecipeError(f"{source}: {exc}") from exc


def _validate_kv(kv: KVCacheRecipe, source: str) -> None:
    from qruntime.kv_layout import KV_DTYPES, KV_LAYOUTS

    if kv.dtype not in KV_DTYPES:
        raise RecipeError(f"{source}: kv_cache.dtype {shown(kv.dtype)} is unknown; known: {', '.join(KV_DTYPES)}")
    if kv.layout not in KV_LAYOUTS:
        raise RecipeError(f"{source}: kv_cache.layout {shown(kv.layout)} is unknown; known: {', '.join(KV_LAYOUTS)}")
    if kv.block_size < 1 or kv.block_size & (kv.block_size - 1) or kv.block_size > 1024:
        raise RecipeError(
            f"{source}: kv_cache.block_size must be a power of two up to 1024, got {shown(kv.block_size)}"
        )
    if kv.calibrate and kv.dtype == "bf16":
        raise RecipeError(f"{source}: kv_cache.calibrate needs an fp8 KV cache (kv_cache.dtype fp8_e4m3)")
    try:
        KV_LAYOUTS[kv.layout].check(kv.block_size, None, kv.dtype)
    except ValueError as exc:
        raise RecipeError(f"{source}: kv_cache: {exc}") from exc


def _validate_vision(vision: VisionRecipe, source: str) -> None:
    if vision.scheme not in VISION_SCHEMES:
        raise RecipeError(
            f"{source}: vision.scheme {shown(vision.scheme)} is unknown; known: {', '.join(VISION_SCHEMES)}"
        )


def _validate_recipe(recipe: Recipe, source: str) -> None:
    from qcompile.graph.passes import PASSES

    for name in recipe.passes:
        if name not in PASSES:
            raise RecipeError(f"{source}: passes: unknown pass {shown(name)}; known: {', '.join(PASSES)}")
    if len(set(recipe.passes)) != len(recipe.passes):
        twice = next(p for i, p in enumerate(recipe.passes) if p in recipe.passes[:i])
        raise RecipeError(f"{source}: passes: {shown(twice)} is listed twice")
    if recipe.tp < 1 or recipe.tp & (recipe.tp - 1) or recipe.tp > 64:
        raise RecipeError(f"{source}: 'tp' must be a power of two between 1 and 64, got {shown(recipe.tp)}")
    if not 1 <= recipe.max_shard_mb <= MAX_SHARD_MB:
        raise RecipeError(
            f"{source}: 'max_shard_mb' must be between 1 and {MAX_SHARD_MB}, got {shown(recipe.max_shard_mb)}"
        )
    if not recipe.name:
        raise RecipeError(f"{source}: 'name' must not be empty")


_VALIDATORS = MappingProxyType(
    {
        QuantizationRecipe: _validate_quantization,
        KVCacheRecipe: _validate_kv,
        VisionRecipe: _validate_vision,
        Recipe: _validate_recipe,
    }
)
