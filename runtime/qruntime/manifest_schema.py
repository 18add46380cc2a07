"""manifest.json's schema: the type and range of every field the runtime or the compiler reads.

`check_manifest` runs on every read (qruntime.artifact.read_manifest), so a junk manifest is one
ArtifactFormatError naming the field (`manifest.json: tensors["x"].shape must be a list, each item
an integer >= 0`), never an AttributeError, KeyError or TypeError where the field is used. A field
is optional unless listed in REQUIRED (a hand-made manifest may hold only `format_version` and
`files`); each reader asks for the fields it needs with `require`. Unknown keys are allowed: a newer
minor version may add fields.

Beyond types, the checks bound what a manifest can make a reader do: `tp` a power of two up to
MAX_TP, and every tensor's bytes (element count x dtype size, in Python integers: no overflow) at
most the size of the listed file that holds it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qruntime.shown import clip
from qruntime.target import TARGETS

TOWER_PREFIX = "model.visual."  # a Qwen3-VL vision tower's tensors (role vision, their scales)
MAX_TP = 64  # the most ranks a manifest may ask for (the loader bounds it again by the devices)
MAX_DIM = 1 << 40  # the largest size of one axis, or count, a manifest may give
REQUIRED = ("format_version", "files")

# safetensors dtype names -> bytes per element (docs/ARTIFACT.md: tensors[*].dtype)
DTYPE_SIZES: Mapping[str, int] = {
    "BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip
SCHEMES = ("ptpc-fp8", "tensor-fp8", "block-fp8", "w4a16", "w4a16-zp", "none")
ROLES = ("embedding", "norm", "linear", "router", "lm_head", "vision", "scale", "zero_point")
QUANT_PARAM_ROLES = ("scale", "zero_point")  # a weight's quantization parameters, not weights themselves
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")


class SchemaError(ValueError):
    """A field is absent or of the wrong type or range; `where` names it, `expected` says what it must be."""

    def __init__(self, where: str, expected: str) -> None:
        super().__init__(f"{where} must be {expected}")
        self.where = where
        self.expected = expected


def key_path(where: str, key: str) -> str:
    """`where["key"]`, the key bounded and printable whatever it holds."""
    return f"{where}[{json.dumps(clip(key))}]"


class _Invalid(Exception):
    """A node's refusal on its way up to Node.check: what the value must be, and the path below the
    checked node, innermost first ('.name' a field, '[i]' an index, '["key"]' a map key). Paths are
    built only for a refused value: a manifest lists thousands of tensor parts (qwen3-235b-a22b: 4 MB),
    and formatting every item's path took most of a read."""

    def __init__(self, expected: str, step: str | None = None) -> None:
        super().__init__(expected)
        self.expected = expected
        self.path = [] if step is None else [step]


def _joined(where: str, path: list[str]) -> str:
    for step in reversed(path):
        where = where + step if step[0] == "[" else f"{where}{step}" if where else step[1:]
    return where


class Node:
    """One schema node: `check(value, where)` raises SchemaError naming `where` and the field below it."""

    def describe(self) -> str:
        raise NotImplementedError

    def check(self, value: Any, where: str) -> None:
        try:
            self.validate(value)
        except _Invalid as exc:
            raise SchemaError(_joined(where, exc.path), exc.expected) from None

    def validate(self, value: Any) -> None:
        """Raise _Invalid where `value` breaks the node (its path relative to this node)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Node):
    lo: int = 0
    hi: int = MAX_DIM
    pow2: bool = False

    def describe(self) -> str:
        kind = "a power of two" if self.pow2 else "an integer"
        return f"{kind} in {self.lo}..{self.hi}"

    def validate(self, value: Any) -> None:
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not self.lo <= value <= self.hi
            or (self.pow2 and value & (value - 1))
        ):
            raise _Invalid(self.describe())


@dataclass(frozen=True)
class Num(Node):
    def describe(self) -> str:
        return "a finite number"

    def validate(self, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise _Invalid(self.describe())


@dataclass(frozen=True)
class Str(Node):
    choices: tuple[str, ...] = ()
    hex_len: int = 0  # exactly this many lowercase hex digits (a digest)
    max_len: int = 4096

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(json.dumps(c) for c in self.choices)
        if self.hex_len:
            return f"{self.hex_len} lowercase hex digits"
        return f"a string of at most {self.max_len} characters"

    def validate(self, value: Any) -> None:
        if not isinstance(value, str) or len(value) > self.max_len:
            raise _Invalid(self.describe())
        if self.choices and value not in self.choices:
            raise _Invalid(self.describe())
        if self.hex_len and (len(value) != self.hex_len or value.strip("0123456789abcdef")):
            raise _Invalid(self.describe())


@dataclass(frozen=True)
class Bool(Node):
    def describe(self) -> str:
        return "true or false"

    def validate(self, value: Any) -> None:
        if not isinstance(value, bool):
            raise _Invalid(self.describe())


@dataclass(frozen=True)
class Opt(Node):
    """The node, or null."""

    node: Node

    def describe(self) -> str:
        return f"null or {self.node.describe()}"

    def validate(self, value: Any) -> None:
        if value is not None:
            try:
                self.node.validate(value)
            except _Invalid as exc:
                if exc.path:  # a field inside the value is named
                    raise
                raise _Invalid(self.describe()) from None


@dataclass(frozen=True)
class List(Node):
    item: Node
    max_len: int = 1 << 24

    def describe(self) -> str:
        return f"a list, each item {self.item.describe()}"

    def validate(self, value: Any) -> None:
        if not isinstance(value, list) or len(value) > self.max_len:
            raise _Invalid(self.describe())
        validate, index = self.item.validate, 0
        try:  # one try for the list (its items are many), the index counted for a refused one
            for item in value:
                validate(item)
                index += 1
        except _Invalid as exc:
            exc.path.append(f"[{index}]")
            raise


@dataclass(frozen=True)
class Tuple(Node):
    items: tuple[Node, ...]

    def describe(self) -> str:
        return "a list of " + ", ".join(n.describe() for n in self.items)

    def validate(self, value: Any) -> None:
        if not isinstance(value, list) or len(value) != len(self.items):
            raise _Invalid(self.describe())
        index = 0
        try:
            for node, item in zip(self.items, value, strict=True):
                node.validate(item)
                index += 1
        except _Invalid as exc:
            exc.path.append(f"[{index}]")
            raise


@dataclass(frozen=True)
class Obj(Node):
    """A JSON object with these fields (each optional unless in `required`; others allowed)."""

    fields: Mapping[str, Node]
    required: tuple[str, ...] = ()

    def describe(self) -> str:
        need = f" with {', '.join(self.required)}" if self.required else ""
        return f"an object{need}"

    def validate(self, value: Any) -> None:
        if not isinstance(value, dict):
            raise _Invalid(self.describe())
        for name in self.required:
            if name not in value:
                raise _Invalid("present", f".{name}")
        for name, node in self.fields.items():
            if name in value:
                try:
                    node.validate(value[name])
                except _Invalid as exc:
                    exc.path.append(f".{name}")
                    raise


@dataclass(frozen=True)
class Map(Node):
    """A JSON object from any key (a string of at most 1024 characters) to `value`."""

    value: Node
    max_len: int = 1 << 22

    def describe(self) -> str:
        return f"an object, each value {self.value.describe()}"

    def validate(self, value: Any) -> None:
        if not isinstance(value, dict) or len(value) > self.max_len:
            raise _Invalid(self.describe())
        validate = self.value.validate
        for key, item in value.items():
            if len(key) > 1024:
                raise _Invalid("a key of at most 1024 characters", key_path("", key))
            try:
                validate(item)
            except _Invalid as exc:
                exc.path.append(key_path("", key))
                raise


SHAPE = List(Int(), max_len=8)
SPAN = Tuple((Int(), Int()))
COUNT = Int(lo=1, hi=1 << 30)

TENSOR = Obj(
    {
        "file": Str(),
        "dtype": Str(choices=tuple(DTYPE_SIZES)),
        "shape": SHAPE,
        "role": Str(choices=ROLES),
        "scheme": Str(choices=SCHEMES),
        "parts": List(List(Tuple((Str(), Int(), Int())))),
        "stacked": Bool(),
        "axis": Opt(Int(hi=7)),
        "ranks": List(Obj({"file": Str(), "shape": SHAPE, "spans": List(SPAN)}, ("file", "shape")), max_len=MAX_TP),
    },
    ("dtype", "shape", "role", "scheme"),
)

MANIFEST_SCHEMA = Obj(
    {
        "format_version": Str(max_len=32),
        "files": Map(Obj({"sha256": Str(max_len=128), "bytes": Int(hi=1 << 50)}, ("sha256", "bytes"))),
        "tp": Int(lo=1, hi=MAX_TP, pow2=True),
        "target": Str(choices=tuple(TARGETS)),  # qruntime.target (absent: nvidia-sm90)
        "tokenizer": Bool(),  # false: compiled with --no-tokenizer (token-id prompts only)
        "synthetic": Obj({"preset": Str()}),  # qcompile synth --artifact: what made the random weights
        "graph": Obj({"file": Str(), "files": List(Str(), max_len=MAX_TP), "opset": Int(), "domains": Map(Int())}),
        "tensors": Map(TENSOR),
        "kv_cache": Obj(
            {
                "dtype": Str(choices=("bf16", "fp8_e4m3")),
                "layout": Obj(
                    {"name": Str(), "k_dims": List(Str()), "v_dims": List(Str())}, ("name", "k_dims", "v_dims")
                ),
                "block_size": COUNT,
                "num_layers": COUNT,
                "num_kv_heads": COUNT,
                "head_dim": COUNT,
                "scales": Opt(
                    Obj(
                        {"calibrated": Bool(), "k_scale": List(Num()), "v_scale": List(Num())},
                        ("calibrated", "k_scale", "v_scale"),
                    )
                ),
            },
            ("dtype", "layout", "block_size", "num_layers", "num_kv_heads", "head_dim"),
        ),
        "spec": Obj(
            {
                "architecture": Str(),
                "dtype": Str(choices=COMPUTE_DTYPES),
                "vocab_size": COUNT,
                "max_position_embeddings": Int(lo=2, hi=1 << 30),
                "num_hidden_layers": COUNT,
                "hidden_size": COUNT,
                "num_attention_heads": COUNT,
                "num_key_value_heads": COUNT,
                "head_dim": COUNT,
                "tie_word_embeddings": Bool(),
                "moe": Opt(Obj({"num_experts": COUNT})),
            }
        ),
        "recipe": Obj(
            {"name": Str(), "quantization": Obj({"scheme": Str(choices=SCHEMES), "ignore": List(Str())}, ("scheme",))}
        ),
        "passes": List(Str()),
        # self-speculative decoding's draft (qcompile compile --draft-layers): the decoder layers it
        # leaves out, and how often that draft agreed with the model on the calibration text
        "speculative": Obj(
            {
                "draft_layers": List(Int(lo=0, hi=1 << 16), max_len=1 << 16),
                "agreement": Opt(Num()),
                "calibration": Opt(Obj({"file": Str(), "sha256": Str(max_len=128), "tokens": Int(lo=0, hi=1 << 40)})),
            },
            ("draft_layers",),
        ),
        # Qwen3-VL (docs/vision.md, "Artifacts"): the vision graph, the tower's and the image
        # preprocessor's configs, the token ids that mark images, and the DeepStack layer count
        "vision": Obj(
            {
                "graph": Str(),
                "scheme": Opt(Str(choices=("none", "ptpc-fp8"))),  # recipe vision.scheme; absent: none
                "tower_config": Obj({}),  # checked by VisionTowerConfig.from_dict at load
                "preprocessor": Obj({}),  # checked by VisionPreprocessConfig.from_dict at load
                "video_preprocessor": Opt(Obj({})),  # VideoPreprocessConfig.from_dict at load; absent: defaults
                "tokens": Obj(
                    {
                        "image_token_id": Int(lo=0, hi=1 << 30),
                        "video_token_id": Opt(Int(lo=0, hi=1 << 30)),
                        "vision_start_token_id": Opt(Int(lo=0, hi=1 << 30)),
                        "spatial_merge_size": Int(lo=1, hi=64),
                    },
                    ("image_token_id", "spatial_merge_size"),
                ),
                "deepstack_layers": Int(lo=0, hi=1 << 16),
                "mrope_section": List(Int(lo=0, hi=1 << 16), max_len=3),
            },
            ("graph", "tower_config", "preprocessor", "tokens", "deepstack_layers", "mrope_section"),
        ),
        "source": Obj(
            {
                "path": Str(),
                "fingerprint": Str(),
                "architecture": Str(),
                "license": Str(),
                "license_name": Str(),
                "license_link": Str(),
            }
        ),
        "toolchain": Map(Opt(Str())),
    },
    REQUIRED,
)


def check_manifest(manifest: Any) -> None:
    """Types (MANIFEST_SCHEMA), then what ties fields together: the graph and tensor entries at the
    artifact's tp, every file they name listed in `files`, every tensor within its file's bytes."""
    MANIFEST_SCHEMA.check(manifest, "")
    files, tp = manifest["files"], manifest.get("tp", 1)
    graph = manifest.get("graph")
    if graph is not None and tp > 1 and len(graph.get("files", ())) != tp:
        raise SchemaError("graph.files", f"a list of {tp} graph files (one per rank at tp={tp})")
    if graph is not None:
        named = [("graph.file", graph["file"])] if "file" in graph else []
        named += [(f"graph.files[{rank}]", name) for rank, name in enumerate(graph.get("files", ()))]
        for where, name in named:
            if name not in files:
                raise SchemaError(where, f"a file listed in files (got {json.dumps(name[:200])})")
    for name, info in manifest.get("tensors", {}).items():
        where = key_path("tensors", name)
        if tp == 1:
            if "file" not in info:
                raise SchemaError(f"{where}.file", "present (a tp=1 artifact names each tensor's file)")
            _check_bytes(info["file"], info["shape"], info["dtype"], files, where)
        elif info["role"] == "vision" or name.startswith(TOWER_PREFIX):  # rank 0 alone runs the encoder: one copy
            if "file" not in info or "ranks" in info or "axis" in info:
                raise SchemaError(
                    f"{where}.file", f"present, without ranks or axis (at tp={tp} rank 0 alone holds a vision tensor)"
                )
            _check_bytes(info["file"], info["shape"], info["dtype"], files, where)
        else:
            ranks = info.get("ranks")
            if ranks is None or len(ranks) != tp:
                raise SchemaError(f"{where}.ranks", f"a list of {tp} entries (one per rank at tp={tp})")
            if info.get("axis") is not None and info["axis"] >= len(info["shape"]):
                raise SchemaError(f"{where}.axis", f"an axis of its shape {info['shape']} or null")
            for rank, entry in enumerate(ranks):
                _check_bytes(entry["file"], entry["shape"], info["dtype"], files, f"{where}.ranks[{rank}]")
    scales = (manifest.get("kv_cache") or {}).get("scales")
    if scales:
        layers = manifest["kv_cache"]["num_layers"]
        for kind in ("k_scale", "v_scale"):
            if len(scales[kind]) != layers:
                raise SchemaError(f"kv_cache.scales.{kind}", f"a list of {layers} numbers (one per layer)")


def _check_bytes(file: str, shape: list[int], dtype: str, files: Mapping[str, Any], where: str) -> None:
    if file not in files:
        raise SchemaError(f"{where}.file", f"a file listed in files (got {json.dumps(file[:200])})")
    need = math.prod(shape) * DTYPE_SIZES[dtype]  # Python integers: a huge shape cannot wrap around
    if need > files[file]["bytes"]:
        raise SchemaError(
            f"{where}.shape", f"a shape whose {need} bytes of {dtype} fit in {file} ({files[file]['bytes']} bytes)"
        )
