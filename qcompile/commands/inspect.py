"""`qcompile inspect ART`: a readable summary of an artifact (or --json for machines).

Given a checkpoint directory instead (config.json, no manifest.json) it opens and checks it as
`compile` would and summarises that: the model, its dtype, and whether it is pre-quantized (the
format, how many linears it stores quantized, the recipe `compile` takes for it)."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import click
from qruntime.artifact import COMPILED_FIELDS, ArtifactFormatError, read_manifest, require
from qruntime.target import DEFAULT_TARGET, get_target

from qcompile.errors import ArtifactError
from qcompile.units import human_bytes, human_count


def summarize(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The facts `inspect` shows, as plain data."""
    from qcompile.io.safetensors_stream import DTYPES  # imports torch: only once the manifest has been read
    from qcompile.quant import get_scheme

    spec, recipe, kv = manifest["spec"], manifest["recipe"], manifest["kv_cache"]
    tensors, tp = manifest["tensors"], manifest.get("tp", 1)
    by_dtype: Counter[str] = Counter()
    params = 0
    for info in tensors.values():
        count = math.prod(info["shape"])  # the whole tensor's (at tp > 1 too)
        # at tp > 1 each rank's slice or copy, but one copy of what rank 0 alone holds (a vision tower)
        stored = [math.prod(rank["shape"]) for rank in info["ranks"]] if "ranks" in info else [count]
        by_dtype[info["dtype"]] += sum(stored) * DTYPES[info["dtype"]].itemsize
        if info["role"] not in ("scale", "zero_point"):  # packed int4 holds 8 parameters a word
            params += math.prod(get_scheme(info["scheme"]).logical_shape(tuple(info["shape"])))
    quantized = sorted({name.rsplit(".", 1)[0] for name, info in tensors.items() if info["role"] == "scale"})
    # the tables the manifest lists (the runtime reads no other): named, not opened
    tuned = sorted(Path(rel).stem for rel in manifest["files"] if rel.startswith("kernels/") and rel.endswith(".json"))
    weight_bytes = sum(f["bytes"] for path, f in manifest["files"].items() if path.startswith("weights/"))
    return {
        "path": str(root),
        "format_version": manifest["format_version"],
        "model": {
            "architecture": spec["architecture"],
            "layers": spec["num_hidden_layers"],
            "hidden_size": spec["hidden_size"],
            "heads": spec["num_attention_heads"],
            "kv_heads": spec["num_key_value_heads"],
            "head_dim": spec["head_dim"],
            "vocab_size": spec["vocab_size"],
            "experts": (spec.get("moe") or {}).get("num_experts"),
            "tied_embeddings": spec["tie_word_embeddings"],
            "parameters": params,
        },
        "recipe": recipe["name"],
        "scheme": recipe["quantization"]["scheme"],
        "ignore": recipe["quantization"]["ignore"],
        "quantized_weights": len(quantized),
        "passes": manifest["passes"],
        "kv_cache": {
            "dtype": kv["dtype"],
            "layout": kv["layout"]["name"],
            "k_dims": kv["layout"]["k_dims"],
            "v_dims": kv["layout"]["v_dims"],
            "block_size": kv["block_size"],
            "calibrated_scales": bool(kv.get("scales") and kv["scales"].get("calibrated")),
        },
        "tp": tp,
        "target": _target(manifest),
        "graphs": [manifest["graph"].get("file", "graph.onnx")] if tp == 1 else list(manifest["graph"]["files"]),
        "kv_heads_per_rank": kv["num_kv_heads"],
        "tuned_devices": tuned,
        "bytes": {"weights": weight_bytes, "by_dtype": dict(by_dtype), "files": len(manifest["files"])},
        "source": manifest["source"],
        "toolchain": manifest["toolchain"],
        "vision": _vision(manifest.get("vision"), tensors),
    }


def _target(manifest: dict[str, Any]) -> dict[str, str]:
    """The compile target (qruntime.target; an artifact without one is nvidia-sm90) and its FP8 format."""
    target = get_target(manifest.get("target", DEFAULT_TARGET))
    return {"name": target.name, "fp8": target.fp8, "gpus": target.description}


def _vision(entry: dict[str, Any] | None, tensors: dict[str, Any]) -> dict[str, Any] | None:
    """A Qwen3-VL artifact's vision part: the tower's shape, its weights, the image settings."""
    if entry is None:
        return None
    tower, tokens, pre = entry["tower_config"], entry["tokens"], entry["preprocessor"]
    size = pre.get("size") or {}
    return {
        "graph": entry["graph"],
        "scheme": entry.get("scheme", "none"),
        "depth": tower.get("depth"),
        "hidden_size": tower.get("hidden_size"),
        "heads": tower.get("num_heads"),
        "patch_size": tower.get("patch_size"),
        "spatial_merge_size": tower.get("spatial_merge_size"),
        "deepstack_layers": entry["deepstack_layers"],
        "mrope_section": entry["mrope_section"],
        "image_token_id": tokens["image_token_id"],
        "pixels": [pre.get("min_pixels", size.get("shortest_edge")), pre.get("max_pixels", size.get("longest_edge"))],
        "tower_tensors": sum(1 for name in tensors if name.startswith("model.visual.")),
        "video": _video(entry.get("video_preprocessor")),
    }


def _video(recorded: dict[str, Any] | None) -> dict[str, Any]:
    """How videos are sampled: the checkpoint's video_preprocessor_config.json as recorded, else
    transformers' Qwen3VLVideoProcessor defaults (what the runtime then uses)."""
    from qruntime.vision.video import VideoPreprocessConfig

    try:
        config = VideoPreprocessConfig() if recorded is None else VideoPreprocessConfig.from_dict(recorded)
    except (TypeError, ValueError) as exc:
        raise ArtifactError(f"manifest.json: vision.video_preprocessor: {exc}") from exc
    return {
        "source": "defaults" if recorded is None else "video_preprocessor_config.json",
        "pixels": [config.min_pixels, config.max_pixels],
        "fps": config.fps,
        "frames": [config.min_frames, config.max_frames],
    }


_VISION_SCHEMES = {"none": "model dtype", "ptpc-fp8": "blocks' linears ptpc-fp8"}  # recipe vision.scheme


def _vision_row(v: dict[str, Any]) -> str:
    return (
        f"{v['graph']} ({_VISION_SCHEMES.get(v['scheme'], v['scheme'])}): {v['depth']} blocks, hidden {v['hidden_size']}, {v['heads']} heads, patch {v['patch_size']}, "
        f"merge {v['spatial_merge_size']}, {v['tower_tensors']} tensors; DeepStack into {v['deepstack_layers']} "
        f"layers, M-RoPE {v['mrope_section']}, image token {v['image_token_id']}, "
        f"{v['pixels'][0]}..{v['pixels'][1]} pixels an image; videos ({v['video']['source']}) at "
        f"{v['video']['fps']} fps, {v['video']['frames'][0]}..{v['video']['frames'][1]} frames, "
        f"{v['video']['pixels'][0]}..{v['video']['pixels'][1]} pixels a video"
    )


def summarize_checkpoint(root: Path) -> dict[str, Any]:
    """The facts `inspect CKPT` shows, as plain data (the checkpoint opened and checked as `compile` does)."""
    from qcompile.recipe.prequantized import default_recipe
    from qcompile.source.checkpoint import Checkpoint  # imports torch: only once a checkpoint is asked about
    from qcompile.source.stored import linear_modules

    checkpoint = Checkpoint.open(root)
    spec, fmt = checkpoint.spec, checkpoint.quantization
    quantization = None
    if fmt is not None:
        kept = [m for m in linear_modules(spec) if f"{m}.weight" not in checkpoint.stored]
        quantization = {
            **fmt.to_dict(),
            "description": fmt.describe(),
            "quantized_linears": len(checkpoint.stored),
            "unquantized_linears": kept,
        }
    return {
        "path": str(root),
        "model": {
            "architecture": spec.architecture,
            "layers": spec.num_hidden_layers,
            "hidden_size": spec.hidden_size,
            "heads": spec.num_attention_heads,
            "kv_heads": spec.num_key_value_heads,
            "head_dim": spec.head_dim,
            "vocab_size": spec.vocab_size,
            "experts": spec.moe.num_experts if spec.moe else None,
            "tied_embeddings": spec.tie_word_embeddings,
        },
        "dtype": spec.dtype,
        "quantization": quantization,
        "recipe": default_recipe(root),
        "tensors": len(checkpoint.tensors),
        "bytes": sum(shard.stat().st_size for shard in checkpoint.shards),
        "shards": len(checkpoint.shards),
        "tokenizer": (root / "tokenizer.json").is_file(),
        "vision": _checkpoint_vision(spec),
    }


def _checkpoint_vision(spec: Any) -> str | None:
    """A Qwen3-VL checkpoint's vision tower, in words (None for Qwen3)."""
    if spec.vision is None:
        return None
    tower = json.loads(spec.vision.tower_config)
    return (
        f"Qwen3-VL tower: {tower.get('depth')} blocks, hidden {tower.get('hidden_size')}, patch "
        f"{tower.get('patch_size')}, merge {spec.vision.spatial_merge_size}; DeepStack into "
        f"{spec.vision.deepstack_layers} layers, M-RoPE {list(spec.vision.mrope_section)}"
    )


def _print_checkpoint(info: dict[str, Any]) -> None:
    m, q = info["model"], info["quantization"]
    experts = f", {m['experts']} experts" if m["experts"] else ""
    rows = [
        ("checkpoint", info["path"]),
        (
            "model",
            f"{m['architecture']}: {m['layers']} layers, hidden {m['hidden_size']}, heads {m['heads']}/{m['kv_heads']} "
            f"x {m['head_dim']}{experts}, vocab {m['vocab_size']}{', tied embeddings' if m['tied_embeddings'] else ''}",
        ),
        ("dtype", info["dtype"]),
        (
            "weights",
            "not quantized"
            if q is None
            else f"pre-quantized, {q['description']}; {q['quantized_linears']} linears stored quantized, "
            f"{len(q['unquantized_linears'])} in {info['dtype']}",
        ),
        ("compiles as", f"recipe {info['recipe']}" + (" (its stored weights copied, not re-quantized)" if q else "")),
        ("files", f"{info['shards']} shard(s), {human_bytes(info['bytes'])}, {info['tensors']} tensors"),
        ("tokenizer", "tokenizer.json" if info["tokenizer"] else "none (compile with --no-tokenizer)"),
        *([("vision", info["vision"])] if info["vision"] else []),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")


def _tp(info: dict[str, Any]) -> str:
    tp = info["tp"]
    if tp == 1:
        return "1"
    heads = info["model"]["heads"] // tp
    per_rank = info["bytes"]["weights"] / tp
    return (
        f"{tp} (pre-sharded: per rank {heads} query / {info['kv_heads_per_rank']} KV head(s), "
        f"{human_bytes(per_rank)} of weights in weights/rank<r>/, graphs {info['graphs'][0]} … {info['graphs'][-1]})"
    )


def _stored(info: dict[str, Any]) -> str:
    """How a pre-quantized source stored its weights (they were copied, not quantized again)."""
    stored = info["source"].get("quantization")
    if not isinstance(stored, dict):
        return ""
    return f", pre-quantized: {stored.get('method')} {stored.get('format')}, transcoded"


@click.command("inspect")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def command(artifact: Path, as_json: bool) -> None:
    """Summarise ARTIFACT: model, scheme, sizes, passes, KV layout, tuned devices.

    Given a checkpoint directory (config.json, no manifest.json), check it as `compile` would and
    summarise it: model, dtype, whether it is pre-quantized and how, the recipe it compiles with."""
    if not (artifact / "manifest.json").exists() and (artifact / "config.json").is_file():
        checkpoint = summarize_checkpoint(artifact)
        if as_json:
            click.echo(json.dumps(checkpoint, indent=1))
        else:
            _print_checkpoint(checkpoint)
        return
    try:
        manifest = read_manifest(artifact)
        require(manifest, artifact, *COMPILED_FIELDS)
    except ArtifactFormatError as exc:
        raise ArtifactError(str(exc)) from exc
    info = summarize(artifact, manifest)
    if as_json:
        click.echo(json.dumps(info, indent=1))
        return
    m, kv = info["model"], info["kv_cache"]
    experts = f", {m['experts']} experts" if m["experts"] else ""
    rows = [
        ("artifact", f"{info['path']} (format {info['format_version']})"),
        (
            "model",
            f"{m['architecture']}: {human_count(m['parameters'])} params, {m['layers']} layers, "
            f"hidden {m['hidden_size']}, heads {m['heads']}/{m['kv_heads']} x {m['head_dim']}{experts}, "
            f"vocab {m['vocab_size']}{', tied embeddings' if m['tied_embeddings'] else ''}",
        ),
        ("recipe", f"{info['recipe']} (scheme {info['scheme']}, {info['quantized_weights']} quantized weights)"),
        ("ignore", ", ".join(info["ignore"]) or "-"),
        ("passes", ", ".join(info["passes"]) or "(none: unfused graph)"),
        (
            "kv cache",
            f"{kv['dtype']}, layout {kv['layout']} K[{', '.join(kv['k_dims'])}] "
            f"V[{', '.join(kv['v_dims'])}], block {kv['block_size']}"
            + (", calibrated scales" if kv["calibrated_scales"] else ""),
        ),
        ("tp", _tp(info)),
        ("target", f"{info['target']['name']} ({info['target']['gpus']}; FP8 weights {info['target']['fp8']})"),
        (
            "weights",
            f"{human_bytes(info['bytes']['weights'])} ("
            + ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(info["bytes"]["by_dtype"].items()))
            + ")",
        ),
        *([("vision", _vision_row(info["vision"]))] if info["vision"] else []),
        ("tuned for", ", ".join(info["tuned_devices"]) or "none"),
        ("source", f"{info['source']['path']} (fingerprint {info['source']['fingerprint'][:16]}…)" + _stored(info)),
        ("made with", ", ".join(f"{k} {v}" for k, v in info["toolchain"].items() if v)),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")
