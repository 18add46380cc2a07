"""`qcompile export ART --format compressed-tensors -o DIR`: an artifact as a portable checkpoint.

compressed-tensors is the checkpoint format llm-compressor writes and transformers (with the
compressed-tensors package), vLLM and SGLang load. The export is what llm-compressor writes for the
same checkpoint and scheme:

    DIR/
      model.safetensors                    # or model-0000k-of-0000n.safetensors + model.safetensors.index.json
      config.json                          # the source's config + quantization_config (compressed-tensors)
      tokenizer files, generation_config.json, LICENSE*    # the artifact's copies of the source's
      README.md                            # where it came from: source fingerprint, recipe

Tensors carry the source checkpoint's names again: fused and stacked weights split back by
`split_to_sources` (losslessly: fusing only moves rows), FP8 `<linear>.weight` with its
`<linear>.weight_scale` (model dtype: [out, 1] per channel, [1] per tensor, [ceil(out/128),
ceil(in/128)] per block), int4 (`w4a16`, `pack-quantized`) `<linear>.weight_packed` int32 [out, in/8]
with `weight_scale` [out, in/128] and `weight_shape` (int64 [out, in]); with zero points (`w4a16-zp`,
`symmetric: false`) also `weight_zero_point` int32 [ceil(out/8), in/128], the codes packed eight rows
to a word as compressed-tensors packs them; everything unquantized as it was. An FP8 lm_head of a
tied model is its own `lm_head.weight` and config.json says `tie_word_embeddings: false` (as llm-compressor unties
it). An FP8 KV cache adds `model.layers.{i}.self_attn.k_scale` / `v_scale` ([1], model dtype) and
the `kv_cache_scheme`.

A Qwen3-VL artifact exports to what transformers 5.17's Qwen3VL(Moe)ForConditionalGeneration loads
(`qwen3_vl.py`): the text tensors under `model.language_model.`, the tower's `model.visual.*` as
they were (and in the quantization_config's ignore list), unquantized MoE experts stacked into
`mlp.experts.gate_up_proj` / `down_proj` (quantized ones are refused), and preprocessor_config.json
from the manifest's vision entry.

Order of work: read the manifest (tp 1 only), check the target, verify every file against its
sha256, lay the output tensors out over shards from the manifest alone, then stream: each source
part is read from the artifact and written at its place in a shard whose header was fixed up front,
so memory holds one part at a time whatever the model's size. All of it goes into a temporary
directory beside DIR, renamed into place when complete.
"""

from __future__ import annotations

import errno
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from qruntime import bounded_json
from qruntime.artifact import ArtifactFormatError, artifact_path
from qruntime.manifest_schema import QUANT_PARAM_ROLES
from qruntime.target import DEFAULT_TARGET

from qcompile.compile.manifest import read_compiled, require_verified
from qcompile.errors import ExportError
from qcompile.io.atomic import atomic_output_dir, check_free_space, check_target
from qcompile.io.safetensors_stream import DTYPES, OutputTensor, StreamingWriter
from qcompile.progress import progress_bar
from qcompile.publish import qwen3_vl
from qcompile.publish.export_readme import export_readme
from qcompile.publish.unfuse import compressed_names, scale_of, split_with_schemes, zero_point_of
from qcompile.quant import get_scheme
from qcompile.quant.int4 import PER_INT32, pack_rows_int4
from qcompile.recipe.quant_config import fp8_kv_cache_scheme, quantization_config
from qcompile.recipe.schema import recipe_from_dict
from qcompile.source.checkpoint import GENERATION_FILE, TOKENIZER_FILES

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD = 5 * 10**9  # Hugging Face's default max_shard_size, "5GB"

Group = tuple[OutputTensor, ...]  # tensors that share a shard: a weight and its scale, a layer's K/V scales


@dataclass(frozen=True)
class Piece:
    """Where one tensor of the artifact's sources goes: `output` at byte `offset` (0 but for a
    Qwen3-VL expert's rows of its stacked tensor), with the dtype and shape it must have."""

    output: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def export_compressed_tensors(
    artifact: str | Path,
    output: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD,
    force: bool = False,
    progress: bool = True,
) -> list[str]:
    """Write the compressed-tensors checkpoint of `artifact` at `output`; returns its file names."""
    root, output = Path(artifact), Path(output).absolute()
    manifest = read_compiled(root, ExportError)
    if manifest.get("tp", 1) != 1:
        raise ExportError(
            f"{root}: sharded for tp={manifest['tp']}; export reads tp=1 artifacts only (not supported yet): "
            "compile with tp: 1 and export that"
        )
    if manifest.get("target", DEFAULT_TARGET) != DEFAULT_TARGET:
        raise ExportError(
            f"{root}: compiled for {manifest['target']} (float8_e4m3fnuz weights), which compressed-tensors does not "
            f"store; export the {DEFAULT_TARGET} artifact of the same checkpoint (its weights dequantize to the "
            "same values)"
        )
    check_target(output, force)
    if output.resolve() == root.resolve() or output.resolve() in root.resolve().parents:
        raise ExportError(f"{output}: the export would replace the artifact it reads; choose another directory")
    require_verified(root, manifest, progress, ExportError, "exported")
    groups, pieces, kv_values = _layout(manifest)
    shards = _shards(groups, max_shard_bytes)
    total = sum(t.nbytes for shard in shards.values() for t in shard)
    check_free_space(output.parent, total, "the export", ExportError)
    with atomic_output_dir(output, force) as tmp:
        with progress_bar(total, "export", progress) as bar:
            try:
                _write_weights(tmp, root, shards, pieces, kv_values, bar.update)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise ExportError(f"{output}: the disk filled up while writing weights ({exc})") from exc
                raise
        if len(shards) > 1:
            weight_map = {t.name: file for file, shard in shards.items() for t in shard}
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        lm_head = any(t.name.startswith("lm_head.") for g in groups for t in g)
        config = _config(root, manifest, lm_head)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if qwen3_vl.is_vision(manifest):
            (tmp / qwen3_vl.PREPROCESSOR_FILE).write_text(qwen3_vl.preprocessor_json(manifest), encoding="utf-8")
            if (video := qwen3_vl.video_preprocessor_json(manifest)) is not None:
                (tmp / qwen3_vl.VIDEO_PREPROCESSOR_FILE).write_text(video, encoding="utf-8")
        for rel in manifest["files"]:
            if rel in (*TOKENIZER_FILES, GENERATION_FILE) or (
                rel.startswith(("LICENSE", "LICENCE")) and "/" not in rel
            ):
                shutil.copyfile(_confined(root, rel, manifest), tmp / rel)
        (tmp / "README.md").write_text(export_readme(manifest, config), encoding="utf-8")
        names = sorted(p.name for p in tmp.iterdir())
    return names


EXPORTERS: MappingProxyType[str, Callable[..., list[str]]] = MappingProxyType(
    {"compressed-tensors": export_compressed_tensors}
)


def _confined(root: Path, rel: str, manifest: dict[str, Any]) -> Path:
    """The artifact's file `rel`: listed by its manifest, reached through no link (never a copy of a link)."""
    try:
        return artifact_path(root, rel, listed=manifest["files"])
    except ArtifactFormatError as exc:
        raise ExportError(str(exc)) from exc


def _layout(manifest: dict[str, Any]) -> tuple[list[Group], dict[str, Piece], dict[str, torch.Tensor]]:
    """Every tensor the export writes, grouped, in the order `split_to_sources` yields them (the K/V
    scales last, with their values), and where each tensor `_sources` yields goes (a Qwen3-VL
    expert's weight: its rows of the stacked tensor), from the manifest alone."""
    tensors, vision = manifest["tensors"], qwen3_vl.is_vision(manifest)
    rename = qwen3_vl.checkpoint_name if vision else (lambda name: name)
    groups: list[Group | str] = []  # a str: the place of the stacked experts tensor of that name
    pieces: dict[str, Piece] = {}
    experts: dict[str, list[qwen3_vl.ExpertPart]] = {}

    def place(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> OutputTensor:
        out = OutputTensor(rename(name), dtype, shape)
        pieces[name] = Piece(out.name, 0, dtype, shape)
        return out

    for name, info in tensors.items():
        if info["role"] in QUANT_PARAM_ROLES:  # a scale or zero point: placed with its weight
            continue
        _check_parts(name, info)
        scheme, scale = get_scheme(info["scheme"]), tensors.get(scale_of(name))
        shape = info["shape"][1:] if info["stacked"] else info["shape"]
        for parts in info["parts"]:
            for source, begin, end in parts:
                part = (end - begin, *shape[1:])  # as stored (packed int4: words of 8 columns)
                stack = qwen3_vl.expert_stack(source) if vision else None
                if stack is not None:  # written into its stacked tensor, unquantized
                    qwen3_vl.check_expert_scheme(source, info["scheme"], scheme.quantized)
                    if stack not in experts:
                        groups.append(stack)
                    experts.setdefault(stack, []).append((source, DTYPES[info["dtype"]], part))
                    continue
                weight_name, scale_name, shape_name = compressed_names(
                    "lm_head.weight" if info["role"] == "lm_head" else source, scheme
                )
                group = [place(weight_name, DTYPES[info["dtype"]], part)]
                if scale is not None:
                    scale_shape = (1,) if scheme.per_tensor else scheme.scale_shape(scheme.logical_shape(part))
                    group.append(place(scale_name, DTYPES[scale["dtype"]], tuple(scale_shape)))
                if shape_name is not None:
                    group.append(place(shape_name, torch.int64, (2,)))
                if scheme.zero_point:  # one code per group scale, packed along the rows eight to a word
                    rows, cols = scheme.logical_shape(part)
                    zp_shape = (-(-rows // PER_INT32), cols // scheme.int4.group_size)
                    group.append(place(zero_point_of(weight_name), torch.int32, zp_shape))
                groups.append(tuple(group))
    for stack, parts in experts.items():
        out, offsets = qwen3_vl.stack_layout(stack, parts)
        groups[groups.index(stack)] = (out,)
        pieces |= {source: Piece(out.name, offsets[source], dtype, shape) for source, dtype, shape in parts}
    kv = manifest["kv_cache"]
    values: dict[str, torch.Tensor] = {}
    if kv["dtype"] != "bf16":
        if kv["dtype"] != "fp8_e4m3" or not kv.get("scales"):
            raise ExportError(
                f"manifest kv_cache: dtype {kv['dtype']!r} with scales {kv.get('scales')!r}; the compressed-tensors "
                "export writes a bf16 cache, or fp8_e4m3 with per-layer k_scale / v_scale"
            )
        dtype = getattr(torch, manifest["spec"]["dtype"])  # llm-compressor: the attention's parameter dtype
        for i in range(kv["num_layers"]):
            group = []
            for kind in ("k", "v"):
                name = f"model.layers.{i}.self_attn.{kind}_scale"
                values[name] = torch.tensor([kv["scales"][f"{kind}_scale"][i]], dtype=torch.float32).to(dtype)
                group.append(place(name, dtype, (1,)))
            groups.append(tuple(group))
    return [g for g in groups if not isinstance(g, str)], pieces, values


def _check_parts(name: str, info: dict[str, Any]) -> None:
    """A weight's `parts` and `stacked` (types checked on read) must describe rows of its shape."""
    where = f"manifest.json: tensors[{name[:200]!r}]"
    if "parts" not in info or "stacked" not in info:
        raise ExportError(f"{where}: a weight needs `parts` and `stacked` to be split back into its sources")
    shape = info["shape"][1:] if info["stacked"] else info["shape"]
    slices = info["shape"][0] if info["stacked"] else 1
    if not shape or len(info["parts"]) != slices:
        raise ExportError(f"{where}: {len(info['parts'])} part lists for shape {info['shape']}")
    for parts in info["parts"]:
        for _, begin, end in parts:
            if not begin < end <= shape[0]:
                raise ExportError(f"{where}: part rows {begin}..{end} are not inside its {shape[0]} rows")


def _shards(groups: list[Group], max_bytes: int) -> dict[str, Group]:
    """File name -> tensors, filled in order up to `max_bytes` (a group larger alone gets its own)."""
    shards: list[list[OutputTensor]] = [[]]
    size = 0
    for group in groups:
        nbytes = sum(t.nbytes for t in group)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += nbytes
    if len(shards) == 1:
        return {SINGLE_FILE: tuple(shards[0])}
    n = len(shards)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": tuple(s) for i, s in enumerate(shards)}


def _sources(root: Path, kv_values: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, weight, scale, scheme, zero_point in split_with_schemes(root):
        weight_name, scale_name, shape_name = compressed_names(name, scheme)
        yield weight_name, weight
        if scale is not None:
            yield scale_name, scale
        if shape_name is not None:  # compressed-tensors' record of the unpacked [rows, columns]
            yield shape_name, torch.tensor(scheme.logical_shape(tuple(weight.shape)), dtype=torch.int64)
        if zero_point is not None:
            yield zero_point_of(weight_name), pack_rows_int4(zero_point)
    yield from kv_values.items()


def _write_weights(
    tmp: Path,
    root: Path,
    shards: dict[str, Group],
    pieces: dict[str, Piece],
    kv_values: dict[str, torch.Tensor],
    advance: Callable[[int], Any],
) -> None:
    """Stream every tensor into its shard, at its place in its output tensor; each file is opened at
    its first piece and closed at its last. Every planned piece must arrive exactly once, as planned
    (a strict bijection)."""
    file_of = {t.name: file for file, shard in shards.items() for t in shard}
    planned = dict(pieces)
    left: dict[str, int] = {}
    for piece in planned.values():
        left[file_of[piece.output]] = left.get(file_of[piece.output], 0) + 1
    writers: dict[str, StreamingWriter] = {}
    try:
        for name, tensor in _sources(root, kv_values):
            if name not in planned:
                raise ExportError(f"{root}: tensor {name!r} is not in the manifest's layout, or comes twice")
            piece = planned.pop(name)
            if tensor.dtype != piece.dtype or tuple(tensor.shape) != piece.shape:
                raise ExportError(
                    f"{root}: tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, but the manifest makes it "
                    f"{piece.dtype} {list(piece.shape)}; the artifact is inconsistent"
                )
            file = file_of[piece.output]
            if file not in writers:
                writers[file] = StreamingWriter(tmp / file, list(shards[file]), metadata={"format": "pt"})
            writers[file].write(piece.output, piece.offset, tensor)
            advance(tensor.numel() * tensor.element_size())
            left[file] -= 1
            if not left[file]:
                writers.pop(file).close()
    finally:
        for writer in writers.values():
            writer.close()
    if planned:
        raise ExportError(f"{root}: tensor {next(iter(planned))!r} of the manifest was not found in the weights")


def _config(root: Path, manifest: dict[str, Any], lm_head: bool) -> dict[str, Any]:
    """The artifact's config.json (the source's, with the artifact's quantization_config) with the
    quantization_config rebuilt from the recorded recipe, plus the KV cache's scheme."""
    path = _confined(root, "config.json", manifest)
    try:
        config = bounded_json.loads(path.read_bytes(), what=str(path))
    except ValueError as exc:
        raise ExportError(f"{path}: not a JSON config ({exc})") from exc
    if not isinstance(config, dict):
        raise ExportError(f"{path}: not a JSON object")
    recipe = recipe_from_dict(manifest["recipe"], f"{root}/manifest.json recipe")
    kv_scheme = fp8_kv_cache_scheme() if manifest["kv_cache"]["dtype"] != "bf16" else None
    qconfig = quantization_config(get_scheme(recipe.quantization.scheme), recipe, kv_scheme)
    config.pop("quantization_config", None)
    if lm_head and config.get("tie_word_embeddings"):
        config["tie_word_embeddings"] = False  # an FP8 lm_head from the tied embedding is its own tensor
        if isinstance(config.get("text_config"), dict) and "tie_word_embeddings" in config["text_config"]:
            config["text_config"]["tie_word_embeddings"] = False  # Qwen3-VL's: transformers reads the top one
    if qconfig is not None:
        vision = qwen3_vl.is_vision(manifest)
        config["quantization_config"] = qwen3_vl.vision_quantization_config(qconfig) if vision else qconfig
    return config
