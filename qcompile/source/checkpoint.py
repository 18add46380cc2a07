"""Open a Hugging Face Qwen3 checkpoint and prove it complete before any work starts.

`Checkpoint.open` reads config.json into a ModelSpec, then every shard's header (never the
tensor data), and checks that each expected tensor is present exactly once with the right shape
and dtype. Tensors are then read lazily, by row range, through `TensorEntry.read_rows`.

A pre-quantized checkpoint (config.json's quantization_config: qcompile.source.quantized) stores
its quantized linears as weight + scale tensors; they are checked and grouped into StoredWeights
(qcompile.source.stored) under the logical names a bf16 checkpoint gives them, with their logical
shapes, so the rest of the compiler asks `source_shapes()` and finds the same names either way.

A Qwen3-VL checkpoint (qcompile.source.qwen3_vl) is read the same way under Qwen3's names, its stacked
experts as per-expert tensors; its vision tower's tensors (`model.visual.*`) are checked with the rest
but are not sources of the text graph (`tower_tensors()`, not `source_shapes()`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from qruntime.artifact import sha256_file
from qruntime.shown import shown

from qcompile.errors import CheckpointError
from qcompile.io import bounded_yaml
from qcompile.io.safetensors_stream import DTYPE_NAMES, TensorEntry, read_header
from qcompile.source import qwen3_vl
from qcompile.source.directory import check_checkpoint_dir
from qcompile.source.model import LM_HEAD, count_expected, expected_tensors, iter_expected
from qcompile.source.quantized import read_format
from qcompile.source.sizes import check_sizes
from qcompile.source.spec import ModelSpec, load_config, read_json
from qcompile.source.stored import StoredWeight, check_unquantized, collect_stored
from qcompile.source.stored_format import StoredFormat

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Files copied into the artifact when the source has them.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
# What qruntime needs to turn text into token ids; an artifact without it serves token-id prompts only.
REQUIRED_TOKENIZER_FILES = ("tokenizer.json",)
GENERATION_FILE = "generation_config.json"
MAX_INDEX_BYTES = 64 << 20  # a shard index names each tensor once: ~2 MB for the largest Qwen3
MAX_NAME_BYTES = 255  # of a shard's file name (NAME_MAX: a longer one makes is_file() raise)
CARD_FILE = "README.md"  # the model card; its YAML front matter may name the license
# names of the tensors quantizers add beside a weight: found in a checkpoint whose config.json says nothing
# of quantization, they (and FP8 weights) get NO_CONFIG_HINT
QUANTIZED_KEYS = (
    ".weight_scale",
    ".weight_scale_inv",
    ".weight_packed",
    ".weight_shape",
    ".weight_zero_point",
    ".input_scale",
    ".qweight",
    ".qzeros",
)
NO_CONFIG_HINT = (
    "; it looks quantized, but config.json has no quantization_config saying how (a pre-quantized "
    "checkpoint is read from its compressed-tensors, Qwen fp8 or AutoAWQ quantization_config)"
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint: its spec, raw config and where every tensor lives.

    `tensors` holds every tensor of the shards as stored (a Qwen3-VL checkpoint's under the names the
    compiler reads: qcompile.source.qwen3_vl); for a pre-quantized checkpoint `stored`
    holds its quantized linears by logical name (`{module}.weight`) and `quantization` their format."""

    path: Path
    config: dict
    spec: ModelSpec
    shards: tuple[Path, ...]
    tensors: dict[str, TensorEntry]
    unused: tuple[str, ...]  # present but deliberately not used (a tied lm_head), logged at open
    quantization: StoredFormat | None = None
    stored: Mapping[str, StoredWeight] = field(default_factory=dict)

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        root = check_checkpoint_dir(path)
        config = load_config(root / "config.json")
        spec = ModelSpec.from_config(config, source=str(root / "config.json"))
        quantization = read_format(config, source=str(root / "config.json"))
        shards, index = _shard_files(root)
        tensors = _read_headers(shards, index)
        if spec.vision is not None:
            tensors = qwen3_vl.text_view(spec, tensors)
        plain: Mapping[str, TensorEntry | StoredWeight] = tensors
        stored: dict[str, StoredWeight] = {}
        if quantization is not None:
            stored, rest = collect_stored(spec, tensors, quantization)
            plain = {**rest, **stored}
        check_sizes(spec, plain, source=str(root / "config.json"))
        unused = _check_complete(spec, plain, quantized=stored.keys(), described=quantization is not None)
        if quantization is not None:
            check_unquantized(spec, tensors, stored, quantization)
        for name in unused:
            log.warning(
                "%s is in the checkpoint but tie_word_embeddings=true: the artifact ties the output "
                "projection to model.embed_tokens.weight as config.json says; %s is not used",
                name,
                name,
            )
        return cls(root, config, spec, tuple(shards), tensors, unused, quantization, stored)

    def entry(self, name: str) -> TensorEntry:
        return self.tensors[name]

    def source_shapes(self) -> dict[str, tuple[int, ...]]:
        """name -> shape of every source tensor the text graph reads: a stored quantized linear once,
        under its logical name and shape (its scale and other tensors are part of it); a Qwen3-VL
        checkpoint's vision tower is not among them (`tower_tensors`)."""
        parts = {e.name for s in self.stored.values() for e in s.entries()}
        shapes = {
            name: entry.shape
            for name, entry in self.tensors.items()
            if name not in parts and not name.startswith(qwen3_vl.TOWER_PREFIX)
        }
        shapes.update({name: s.shape for name, s in self.stored.items()})
        return shapes

    def tower_tensors(self) -> dict[str, TensorEntry]:
        """name -> entry of a Qwen3-VL checkpoint's vision tower tensors (`model.visual.*`, checked
        complete at open against the tower's vision_config); empty for a Qwen3 checkpoint."""
        return {name: e for name, e in self.tensors.items() if name.startswith(qwen3_vl.TOWER_PREFIX)}

    def require_tokenizer(self) -> None:
        """Refuse a checkpoint without the files qruntime needs to turn text into token ids
        (REQUIRED_TOKENIZER_FILES): its artifact would not load."""
        missing = [name for name in REQUIRED_TOKENIZER_FILES if not (self.path / name).is_file()]
        if missing:
            raise CheckpointError(
                f"{self.path}: no {' or '.join(missing)}: qruntime could not turn text into token ids, so the "
                f"artifact would not load. Copy the base model's tokenizer files ({', '.join(TOKENIZER_FILES[:3])}) "
                "into the checkpoint, or pass --no-tokenizer to compile an artifact without a tokenizer "
                "(for token-id prompts only)"
            )

    def side_files(self, tokenizer: bool = True) -> list[Path]:
        """Tokenizer (unless `tokenizer` is false), generation and license files to copy into the artifact."""
        names = (*(TOKENIZER_FILES if tokenizer else ()), GENERATION_FILE)
        licenses = sorted(p for p in self.path.glob("LICEN[CS]E*") if p.is_file())
        return [self.path / n for n in names if (self.path / n).is_file()] + licenses

    def license(self) -> dict[str, str]:
        """The license fields of the source's model card (README.md front matter): `license`, plus
        `license_name` / `license_link` (used with `license: other`); empty when it names none."""
        meta = front_matter(self.path / CARD_FILE)
        return {k: str(meta[k]) for k in ("license", "license_name", "license_link") if meta.get(k)}


def front_matter(path: Path) -> dict:
    """The YAML between the `---` lines that open a Markdown file (a hub model card's metadata); empty
    when the file or the block is missing or malformed (logged: the card is informative, not needed)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    end = next((i for i, line in enumerate(lines[1:], 1) if line.strip() == "---"), None)
    if end is None:
        log.warning("%s: front matter has no closing '---' line; ignored", path)
        return {}
    try:
        meta = bounded_yaml.loads("\n".join(lines[1:end]), what=f"{path} front matter")
    except yaml.YAMLError as exc:
        log.warning("%s: front matter is not valid YAML (%s); ignored", path, exc)
        return {}
    return meta if isinstance(meta, dict) else {}


def fingerprint(checkpoint: Checkpoint) -> str:
    """sha256 over config.json, the shard index (when present) and each shard's size and sha256."""
    outer = hashlib.sha256()
    outer.update((checkpoint.path / "config.json").read_bytes())
    index = checkpoint.path / INDEX_FILE
    if index.is_file():
        outer.update(index.read_bytes())
    for shard in checkpoint.shards:
        digest = sha256_file(shard)
        outer.update(f"{shard.name}:{shard.stat().st_size}:{digest}\n".encode())
    return outer.hexdigest()


def _shard_files(root: Path) -> tuple[list[Path], dict[str, str] | None]:
    index_path = root / INDEX_FILE
    if index_path.is_file():
        index = read_json(index_path, MAX_INDEX_BYTES)
        if not isinstance(index, dict) or "weight_map" not in index:
            raise CheckpointError(f"{index_path}: malformed shard index (no 'weight_map' object)")
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to file names")
        names = sorted(set(weight_map.values()))
        for name in names:
            if Path(name).name != name or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
                raise CheckpointError(
                    f"{index_path}: shard {shown(name)} must be a file name (at most 255 bytes) in the checkpoint dir"
                )
            if not (root / name).is_file():
                users = sorted(k for k, v in weight_map.items() if v == name)
                raise CheckpointError(
                    f"{root / name}: shard listed in {INDEX_FILE} is missing "
                    f"(it should hold {len(users)} tensors, e.g. {shown(users[0])})"
                )
        return [root / n for n in names], weight_map
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE], None
    stray = sorted(p.name for p in root.glob("*.safetensors"))
    if stray:
        raise CheckpointError(f"{root}: found {', '.join(stray)} but no {INDEX_FILE} saying which tensors each holds")
    raise CheckpointError(f"{root}: no {SINGLE_FILE} or {INDEX_FILE}; only safetensors checkpoints are supported")


def _read_headers(shards: list[Path], index: dict[str, str] | None) -> dict[str, TensorEntry]:
    tensors: dict[str, TensorEntry] = {}
    for shard in shards:
        entries, _ = read_header(shard)
        for name, entry in entries.items():
            if name in tensors:
                raise CheckpointError(
                    f"tensor {shown(name)} is duplicated: in {tensors[name].file.name} and in {shard.name}"
                )
            if index is not None and index.get(name) != shard.name:
                where = index.get(name)
                raise CheckpointError(
                    f"{shard.name}: holds tensor {shown(name)} which {INDEX_FILE} "
                    + (f"places in {shown(where)}" if where else "does not list")
                )
            tensors[name] = entry
    if index is not None:
        for name, shard_name in sorted(index.items()):
            if name not in tensors:
                raise CheckpointError(
                    f"{shown(shard_name)}: tensor {shown(name)} is listed in {INDEX_FILE} but not in the shard"
                )
    return tensors


def _check_complete(
    spec: ModelSpec,
    tensors: Mapping[str, TensorEntry | StoredWeight],
    quantized: Collection[str] = (),
    described: bool = False,
) -> tuple[str, ...]:
    """Every expected tensor present once with the right shape and dtype; nothing unexpected.
    `quantized` names the stored quantized linears among `tensors` (their dtypes checked already);
    `described`: config.json has a quantization_config (else quantized-looking tensors get a hint).

    Counted before it is listed: when the config implies more tensors than the shards hold, the
    first one missing is found by walking the expected names lazily (at most one past the count held)."""
    want = count_expected(spec) + qwen3_vl.tower_count(spec)
    if want > len(tensors):
        first = next(name for name, _ in _iter_all_expected(spec) if name not in tensors)
        raise CheckpointError(
            f"tensor {_missing(spec, first)} is missing from the checkpoint "
            f"(config.json implies {want} tensors, the shards hold {len(tensors)})"
        )
    expected = {**expected_tensors(spec), **dict(qwen3_vl.tower_expected(spec))}
    want_dtype = DTYPE_NAMES[getattr(torch, spec.dtype)]
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"tensor {_missing(spec, missing[0])} is missing from the checkpoint{more}")
    unused: list[str] = []
    for name, entry in tensors.items():
        # a stored quantized linear is named by its weight tensor; its shape is the logical one it holds
        stored = isinstance(entry, StoredWeight)
        shown_name, has = (entry.weight.name, "holds a linear of shape") if stored else (name, "has shape")
        # a Qwen3-VL tensor is named by its stored name and the one it is read as
        held = entry.weight if stored else entry
        named = qwen3_vl.label(shown_name, held)
        if name not in expected:
            if spec.tie_word_embeddings and name == f"{LM_HEAD}.weight":
                unused.append(name)
                continue
            hint = "" if described or not name.endswith(QUANTIZED_KEYS) else NO_CONFIG_HINT
            raise CheckpointError(
                f"{entry.file.name}: unexpected tensor {qwen3_vl.label(shown_name, held, shown)} for "
                f"{spec.architecture} with this config.json{hint}"
            )
        if entry.shape != expected[name]:
            raise CheckpointError(
                f"{entry.file.name}: tensor {named} {has} {list(entry.shape)}, "
                f"config.json implies {list(expected[name])}"
            )
        if name not in quantized and entry.dtype != want_dtype:
            hint = "" if described or not entry.dtype.startswith("F8_") else NO_CONFIG_HINT
            raise CheckpointError(
                f"{entry.file.name}: tensor {named} is {entry.dtype}, config.json says {spec.dtype} ({want_dtype})"
                + hint
            )
    return tuple(unused)


def _iter_all_expected(spec: ModelSpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    """iter_expected(spec), then a Qwen3-VL spec's vision tower tensors."""
    yield from iter_expected(spec)
    yield from qwen3_vl.tower_expected(spec)


def _missing(spec: ModelSpec, name: str) -> str:
    """A missing expected tensor as errors name it: for Qwen3-VL, the stored tensor it is read from."""
    stored = qwen3_vl.stored_name(name) if spec.vision is not None else name
    return repr(name) if stored == name else f"{stored!r} (read as {name!r})"
