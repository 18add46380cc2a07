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
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import yaml
from qruntime import bounded_json
from qruntime.artifact import ArtifactFormatError, artifact_path
from qruntime.manifest_schema import QUANT_PARAM_ROLES

from qcompile.compile.manifest import read_compiled, require_verified
from qcompile.errors import ExportError
from qcompile.io.atomic import atomic_output_dir, check_free_space, check_target
from qcompile.io.safetensors_stream import DTYPES, OutputTensor, StreamingWriter
from qcompile.progress import progress_bar
from qcompile.publish.model_card import base_model_name, describe_scheme
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
    check_target(output, force)
    if output.resolve() == root.resolve() or output.resolve() in root.resolve().parents:
        raise ExportError(f"{output}: the export would replace the artifact it reads; choose another directory")
    require_verified(root, manifest, progress, ExportError, "exported")
    groups, kv_values = _layout(manifest)
    shards = _shards(groups, max_shard_bytes)
    total = sum(t.nbytes for shard in shards.values() for t in shard)
    check_free_space(output.parent, total, "the export", ExportError)
    with atomic_output_dir(output, force) as tmp:
        with progress_bar(total, "export", progress) as bar:
            try:
                _write_weights(tmp, root, shards, kv_values, bar.update)
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
        for rel in manifest["files"]:
            if rel in (*TOKENIZER_FILES, GENERATION_FILE) or (
                rel.startswith(("LICENSE", "LICENCE")) and "/" not in rel
            ):
                shutil.copyfile(_confined(root, rel, manifest), tmp / rel)
        (tmp / "README.md").write_text(_readme(manifest, config), encoding="utf-8")
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


def _layout(manifest: dict[str, Any]) -> tuple[list[Group], dict[str, torch.Tensor]]:
    """Every tensor the export writes, grouped, in the order `split_to_sources` yields them (the K/V
    scales last, with their values), from the manifest alone."""
    tensors = manifest["tensors"]
    groups: list[Group] = []
    for name, info in tensors.items():
        if info["role"] in QUANT_PARAM_ROLES:  # a scale or zero point: placed with its weight
            continue
        _check_parts(name, info)
        scheme, scale = get_scheme(info["scheme"]), tensors.get(scale_of(name))
        shape = info["shape"][1:] if info["stacked"] else info["shape"]
        for parts in info["parts"]:
            for source, begin, end in parts:
                weight_name, scale_name, shape_name = compressed_names(
                    "lm_head.weight" if info["role"] == "lm_head" else source, scheme
                )
                part = (end - begin, *shape[1:])  # as stored (packed int4: words of 8 columns)
                group = [OutputTensor(weight_name, DTYPES[info["dtype"]], part)]
                if scale is not None:
                    scale_shape = (1,) if scheme.per_tensor else scheme.scale_shape(scheme.logical_shape(part))
                    group.append(OutputTensor(scale_name, DTYPES[scale["dtype"]], tuple(scale_shape)))
                if shape_name is not None:
                    group.append(OutputTensor(shape_name, torch.int64, (2,)))
                if scheme.zero_point:  # one code per group scale, packed along the rows eight to a word
                    rows, cols = scheme.logical_shape(part)
                    zp_shape = (-(-rows // PER_INT32), cols // scheme.int4.group_size)
                    group.append(OutputTensor(zero_point_of(weight_name), torch.int32, zp_shape))
                groups.append(tuple(group))
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
                group.append(OutputTensor(name, dtype, (1,)))
            groups.append(tuple(group))
    return groups, values


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
    tmp: Path, root: Path, shards: dict[str, Group], kv_values: dict[str, torch.Tensor], advance: Callable[[int], Any]
) -> None:
    """Stream every tensor into its shard; each file is opened at its first tensor and closed at its
    last. Every planned tensor must arrive exactly once, as planned (a strict bijection)."""
    planned = {t.name: (file, t) for file, shard in shards.items() for t in shard}
    left = {file: len(shard) for file, shard in shards.items()}
    writers: dict[str, StreamingWriter] = {}
    try:
        for name, tensor in _sources(root, kv_values):
            if name not in planned:
                raise ExportError(f"{root}: tensor {name!r} is not in the manifest's layout, or comes twice")
            file, out = planned.pop(name)
            if tensor.dtype != out.dtype or tuple(tensor.shape) != out.shape:
                raise ExportError(
                    f"{root}: tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, but the manifest makes it "
                    f"{out.dtype} {list(out.shape)}; the artifact is inconsistent"
                )
            if file not in writers:
                writers[file] = StreamingWriter(tmp / file, list(shards[file]), metadata={"format": "pt"})
            writers[file].write(name, 0, tensor)
            advance(out.nbytes)
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
    if qconfig is not None:
        config["quantization_config"] = qconfig
    return config


def _readme(manifest: dict[str, Any], config: dict[str, Any]) -> str:
    source, recipe, kv = manifest["source"], manifest["recipe"], manifest["kv_cache"]
    scheme = recipe["quantization"]["scheme"]
    base = base_model_name(source["path"], config)
    meta: dict[str, Any] = {"base_model": base}
    meta |= {k: source[k] for k in ("license", "license_name", "license_link") if source.get(k)}
    int4 = get_scheme(scheme).int4 is not None
    fp8 = "quantization_config" in config and (not int4 or kv["dtype"] != "bf16")
    tags = ["compressed-tensors", "qcompile", "qwen3"] + (["int4"] if int4 else []) + (["fp8"] if fp8 else [])
    meta |= {"library_name": "transformers", "pipeline_tag": "text-generation", "tags": tags}
    kept = ""
    if get_scheme(scheme).quantized:
        ignored = ", ".join(f"`{p}`" for p in recipe["quantization"]["ignore"])
        kept = f"- Kept in the model dtype: embeddings, norms{', ' + ignored if ignored else ''}\n"
    if kv["dtype"] == "bf16":
        cache = "KV cache: bf16 (no scales)."
    else:
        calibrated = "calibrated at compile time" if kv["scales"].get("calibrated") else "1.0, not calibrated"
        cache = f"KV cache: {kv['dtype']}, per-layer `k_scale` / `v_scale` {calibrated} (`kv_cache_scheme`)."
    return (
        "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n\n"
        f"# {base.rsplit('/', 1)[-1]}-{recipe['name']} (compressed-tensors)\n\n"
        "Exported from a qcompile artifact with `qcompile export --format compressed-tensors`: the source "
        "checkpoint's tensor names, quantized as llm-compressor writes them, with a compressed-tensors "
        "`quantization_config` in config.json.\n\n"
        f"- Source: `{source['path']}`, fingerprint (sha256) `{source['fingerprint']}`\n"
        f"- Recipe: `{recipe['name']}`; {describe_scheme(scheme)}\n"
        f"{kept}"
        f"- {cache}\n"
        f"- Made by qcompile {manifest['toolchain'].get('qcompile')}\n\n"
        f"{_loads_with(get_scheme(scheme), config)}\n"
    )


def _loads_with(scheme: Any, config: dict[str, Any]) -> str:
    """What the README says loads the export. Asymmetric int4 experts are the exception: transformers
    5.17 builds each expert without its weight_zero_point and refuses the checkpoint (llm-compressor's
    own W4A16_ASYM MoE checkpoints alike; tests/compile/test_prequantized_w4a16_zp.py checks both)."""
    if scheme.zero_point and config.get("num_experts"):
        return (
            "Asymmetric int4 experts (`weight_zero_point`): transformers 5.17 does not load this checkpoint "
            "(its expert decompression drops the zero points; llm-compressor's own asymmetric MoE checkpoints "
            "fail the same way). Loading by vLLM or SGLang has not been tested."
        )
    return (
        "Loads with transformers (`pip install compressed-tensors`; "
        "`AutoModelForCausalLM.from_pretrained(path)`), vLLM (`vllm serve path`) and SGLang "
        "(`python -m sglang.launch_server --model-path path`)."
    )
