"""The README.md of a compressed-tensors export: Hugging Face front matter, where the checkpoint came
from (source fingerprint, recipe), what stayed unquantized and what loads it."""

from __future__ import annotations

from typing import Any

import yaml

from qcompile.publish import qwen3_vl
from qcompile.publish.model_card import base_model_name, describe_scheme
from qcompile.quant import get_scheme


def export_readme(manifest: dict[str, Any], config: dict[str, Any]) -> str:
    source, recipe, kv = manifest["source"], manifest["recipe"], manifest["kv_cache"]
    scheme = recipe["quantization"]["scheme"]
    base = base_model_name(source["path"], config)
    meta: dict[str, Any] = {"base_model": base}
    meta |= {k: source[k] for k in ("license", "license_name", "license_link") if source.get(k)}
    int4 = get_scheme(scheme).int4 is not None
    fp8 = "quantization_config" in config and (not int4 or kv["dtype"] != "bf16")
    vision = qwen3_vl.is_vision(manifest)
    family, task = ("qwen3_vl", "image-text-to-text") if vision else ("qwen3", "text-generation")
    tags = ["compressed-tensors", "qcompile", family] + (["int4"] if int4 else []) + (["fp8"] if fp8 else [])
    meta |= {"library_name": "transformers", "pipeline_tag": task, "tags": tags}
    kept = ""
    if get_scheme(scheme).quantized:
        ignored = ", ".join(f"`{p}`" for p in recipe["quantization"]["ignore"])
        tower = ", the vision tower" if vision else ""
        kept = f"- Kept in the model dtype: embeddings, norms{tower}{', ' + ignored if ignored else ''}\n"
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
        f"{_loads_with(get_scheme(scheme), config, vision)}\n"
    )


def _loads_with(scheme: Any, config: dict[str, Any], vision: bool) -> str:
    """What the README says loads the export. Asymmetric int4 experts are the exception: transformers
    5.17 builds each expert without its weight_zero_point and refuses the checkpoint (llm-compressor's
    own W4A16_ASYM MoE checkpoints alike; tests/compile/test_prequantized_w4a16_zp.py checks both)."""
    if scheme.zero_point and config.get("num_experts"):
        return (
            "Asymmetric int4 experts (`weight_zero_point`): transformers 5.17 does not load this checkpoint "
            "(its expert decompression drops the zero points; llm-compressor's own asymmetric MoE checkpoints "
            "fail the same way). Loading by vLLM or SGLang has not been tested."
        )
    if vision:
        return (
            "Loads with transformers (`pip install compressed-tensors`; "
            "`AutoModelForImageTextToText.from_pretrained(path)`, with preprocessor_config.json for the "
            "images). Loading by vLLM or SGLang has not been tested."
        )
    return (
        "Loads with transformers (`pip install compressed-tensors`; "
        "`AutoModelForCausalLM.from_pretrained(path)`), vLLM (`vllm serve path`) and SGLang "
        "(`python -m sglang.launch_server --model-path path`)."
    )
