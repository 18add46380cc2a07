"""The model card (README.md) that `qcompile publish` writes beside an artifact.

Hugging Face hub front matter (base_model, license carried from the source, tags, library_name,
pipeline_tag), then what is inside (scheme, ignored layers, KV cache, tuned GPUs, sizes), the
evaluation and speed tables when reports are given, how to run it with the bundled qruntime wheel
and with vLLM, how to reproduce the compile, and the sha256 of every file. Everything comes from
the manifest and the inputs: no dates, no local paths, so the same inputs give the same bytes.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

import yaml

from qcompile.publish.reports import Report, render_reports
from qcompile.quant.schemes import PerBlock, PerChannel, PerGroupInt4, PerTensor, QuantScheme, get_scheme
from qcompile.units import human_bytes, human_count

LIBRARY_NAME = "qruntime"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_LICENSE_KEYS = ("license", "license_name", "license_link")


@dataclass(frozen=True)
class CardInputs:
    """What the card is made of. `manifest`: the compiled artifact's; `files`: every published file but
    README.md and manifest.json (the artifact's files, the runtime wheel, reports) -> {sha256, bytes};
    `tuned`: (kernels file, GPU name) pairs."""

    manifest: dict[str, Any]
    base_model: str
    files: dict[str, dict[str, Any]]
    wheel: str
    reports: tuple[Report, ...] = ()
    tuned: tuple[tuple[str, str], ...] = ()
    chat: bool = False


def base_model_name(source_path: str, config: dict[str, Any]) -> str:
    """The source checkpoint's hub name: `org/name` from a hub cache path (models--org--name) or from
    config.json's `_name_or_path`, else the source directory's name."""
    parts = PurePath(source_path).parts
    for part in reversed(parts):
        if part.startswith("models--") and part.count("--") >= 2:
            return part.removeprefix("models--").replace("--", "/", 1)
    name_or_path = config.get("_name_or_path")
    if isinstance(name_or_path, str) and _REPO_ID.fullmatch(name_or_path):
        return name_or_path
    return next((p for p in reversed(parts) if p not in ("", ".", "..", "/")), "model")


def render_card(inputs: CardInputs) -> str:
    """The whole README.md."""
    m = inputs.manifest
    name = f"{inputs.base_model.rsplit('/', 1)[-1]}-{m['recipe']['name']}"
    sections = [
        _front_matter(inputs),
        _intro(inputs, name),
        _inside(inputs),
        render_reports(inputs.reports),
        _run(inputs, name),
        _reproduce(inputs, name),
        _files(inputs),
    ]
    return "\n".join(s for s in sections if s)


def _front_matter(inputs: CardInputs) -> str:
    m = inputs.manifest
    scheme = _scheme(m["recipe"]["quantization"]["scheme"])
    quantized = scheme is None or scheme.quantized
    meta: dict[str, Any] = {"base_model": inputs.base_model}
    if quantized:
        meta["base_model_relation"] = "quantized"
    meta |= {key: m["source"][key] for key in _LICENSE_KEYS if m["source"].get(key)}
    meta |= {"library_name": LIBRARY_NAME, "pipeline_tag": "text-generation"}
    tags = ["qcompile", "qwen3"]
    if m["spec"].get("moe"):
        tags.append("moe")
    if quantized:
        tags += ["int4" if scheme is not None and scheme.int4 else "fp8", m["recipe"]["quantization"]["scheme"]]
    if m["kv_cache"]["dtype"] != "bf16":
        tags.append("fp8-kv-cache")
    meta["tags"] = tags
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n"


def _intro(inputs: CardInputs, name: str) -> str:
    m = inputs.manifest
    base = inputs.base_model
    link = f"[{base}](https://huggingface.co/{base})" if _REPO_ID.fullmatch(base) else f"`{base}`"
    license_line = (
        f"License: `{m['source']['license']}`, carried from the source checkpoint's model card."
        if m["source"].get("license")
        else "License: not recorded (the source checkpoint's README.md names none); the source's terms apply."
    )
    tp = m.get("tp", 1)
    graph = (
        "the fused execution graph as ONNX (`graph.onnx`)"
        if tp == 1
        else f"pre-sharded for {tp}-way tensor parallelism (each GPU's slice of the weights in "
        f"`weights/rank<r>/`), one fused execution graph per rank as ONNX (`graph.rank0.onnx` … "
        f"`graph.rank{tp - 1}.onnx`)"
    )
    runs = (
        "or, exported to compressed-tensors, on vLLM"
        if tp == 1
        else f"on {tp} GPUs of one host (export to compressed-tensors reads the tp=1 compile)"
    )
    return (
        f"# {name}\n\n"
        f"{link} compiled by qcompile with the `{m['recipe']['name']}` recipe "
        f"({m['recipe'].get('description') or m['recipe']['quantization']['scheme']}): weights quantized and "
        f"pre-fused for the kernels, the KV-cache layout decided ahead of time, {graph} and a manifest with "
        "the sha256 of every file. It runs on **qruntime**, the lean "
        f"runtime bundled here as a wheel (`{inputs.wheel}`), {runs}.\n\n"
        f"{license_line}\n"
    )


def _scheme(name: str) -> QuantScheme | None:
    try:
        return get_scheme(name)
    except KeyError:
        return None


def describe_scheme(name: str) -> str:
    """What a scheme means, from its typed value in the registry."""
    scheme = _scheme(name)
    if scheme is None:
        return f"`{name}`"
    if not scheme.quantized:
        return f"`{name}`: not quantized, weights in the model dtype"
    w = scheme.weights
    if isinstance(w, PerGroupInt4) and w.zero_point:
        return (
            f"`{name}`: int4 weights with zero points (asymmetric), one scale and one zero point per "
            f"{w.group_size} input columns of a row, copied from the pre-quantized source; activations in the "
            "model dtype"
        )
    if isinstance(w, PerGroupInt4):
        text = (
            f"`{name}`: int4 weights (symmetric, round to nearest), one scale per {w.group_size} input columns "
            "of a row; activations in the model dtype"
        )
        if scheme.llmcompressor_scheme:
            text += f"; the weights are byte-identical to llm-compressor's `{scheme.llmcompressor_scheme}`"
        return text
    if isinstance(w, PerChannel):
        weights = "one scale per output channel"
    elif isinstance(w, PerTensor):
        weights = "one scale per source tensor"
    elif isinstance(w, PerBlock):
        weights = f"one scale per {w.block_n}×{w.block_k} block"
    else:
        weights = type(w).__name__
    group = scheme.activation_group
    acts = "per token" if group == 0 else "per tensor (one scale per step)" if group < 0 else f"per 1×{group} group"
    text = f"`{name}`: FP8 (e4m3) weights, {weights}; activations quantized to FP8 {acts} at run time"
    if scheme.llmcompressor_scheme:
        text += f"; the weights are byte-identical to llm-compressor's `{scheme.llmcompressor_scheme}`"
    return text


def _logical(name: str, shape: list[int]) -> tuple[int, ...]:
    scheme = _scheme(name)
    return tuple(shape) if scheme is None else scheme.logical_shape(tuple(shape))


def _kept(manifest: dict[str, Any]) -> str:
    """The linear weights kept unquantized, layer indices folded: `lm_head`, `model.layers.*.mlp.gate` ×48."""
    kept: Counter[str] = Counter()
    for tensor, info in manifest["tensors"].items():
        if info["role"] in ("linear", "lm_head", "router") and info["scheme"] == "none":
            kept[re.sub(r"\.layers\.\d+\.", ".layers.*.", tensor.removesuffix(".weight"))] += 1
    names = [f"`{k}`" + (f" ×{n}" if n > 1 else "") for k, n in sorted(kept.items())]
    own_head = any(name.startswith("lm_head.") for name in manifest["tensors"])  # `weight` or `weight_packed`
    if manifest["spec"].get("tie_word_embeddings") and not own_head:
        names.append("`lm_head` (tied: it reads the embedding table)")
    return ", ".join(names) or "none"


def _kv(kv: dict[str, Any]) -> str:
    layout = kv["layout"]
    text = (
        f"{kv['dtype']}, layout `{layout['name']}` K[{', '.join(layout['k_dims'])}] "
        f"V[{', '.join(layout['v_dims'])}], block size {kv['block_size']}"
    )
    scales = kv.get("scales")
    if not scales:
        return text + "; no scales (unquantized cache)"
    if scales.get("calibrated"):
        k, v = scales["k_scale"], scales["v_scale"]
        return (
            text + f"; per-layer K/V scales calibrated at compile time (k_scale {min(k):.4g}–{max(k):.4g}, "
            f"v_scale {min(v):.4g}–{max(v):.4g}; in manifest.json)"
        )
    return text + "; scales 1.0 for every layer (not calibrated)"


def _tp(manifest: dict[str, Any]) -> str:
    tp = manifest.get("tp", 1)
    if tp == 1:
        return "1"
    spec = manifest["spec"]
    return (
        f"{tp}: pre-sharded, rank r's weights in `weights/rank<r>/` and its graph `graph.rank<r>.onnx`; per GPU "
        f"{spec['num_attention_heads'] // tp} query / {manifest['kv_cache']['num_kv_heads']} KV head(s)"
    )


def _inside(inputs: CardInputs) -> str:
    m = inputs.manifest
    spec, recipe, tensors = m["spec"], m["recipe"], m["tensors"]
    params = sum(
        math.prod(_logical(t["scheme"], t["shape"]))
        for t in tensors.values()
        if t["role"] not in ("scale", "zero_point")
    )  # packed int4 weights count their 8 values a word
    quantized = sum(1 for t in tensors.values() if t["role"] == "scale")
    moe = spec.get("moe") or {}
    model = (
        f"{spec['architecture']}: {human_count(params)} parameters, {spec['num_hidden_layers']} layers, hidden "
        f"{spec['hidden_size']}, heads {spec['num_attention_heads']}/{spec['num_key_value_heads']} × "
        f"{spec['head_dim']}, vocab {spec['vocab_size']}"
        + (f", {moe['num_experts']} experts top-{moe['num_experts_per_tok']}" if moe.get("num_experts") else "")
        + (", tied embeddings" if spec.get("tie_word_embeddings") else "")
    )
    artifact = m["files"]
    weights = [f for p, f in m["files"].items() if p.startswith("weights/")]
    by_dtype: Counter[str] = Counter()
    for t in tensors.values():
        by_dtype[t["dtype"]] += 1
    tuned = ", ".join(f"{device} (`{path}`)" for path, device in inputs.tuned) or (
        "none: the runtime uses its default kernel configs (`qcompile tune ART` on a GPU adds them)"
    )
    toolchain = ", ".join(f"{k} {v}" for k, v in m["toolchain"].items() if v)
    rows = [
        ("model", model),
        ("scheme", describe_scheme(recipe["quantization"]["scheme"])),
        ("quantized", f"{quantized} linear weights"),
        (
            "ignore",
            ", ".join(f"`{p}`" for p in recipe["quantization"]["ignore"]) or "nothing",
        ),
        ("kept unquantized", f"{_kept(m)}; embeddings and norms are not linear layers and stay in the model dtype"),
        ("fusion passes", ", ".join(f"`{p}`" for p in m["passes"]) or "none (unfused graph)"),
        ("KV cache", _kv(m["kv_cache"])),
        ("tensor parallel", _tp(m)),
        ("tuned kernels", tuned),
        (
            "size",
            f"{human_bytes(sum(f['bytes'] for f in artifact.values()))} in {len(artifact)} files and manifest.json; weights "
            f"{human_bytes(sum(f['bytes'] for f in weights))} in {len(weights)} safetensors file(s), {len(tensors)} "
            "tensors (" + ", ".join(f"{n} {d}" for d, n in sorted(by_dtype.items())) + ")",
        ),
        ("format", f"qcompile artifact format {m['format_version']}; made with {toolchain}"),
    ]
    table = "\n".join(f"| {key} | {value} |" for key, value in rows)
    return "## What is inside\n\n| | |\n|---|---|\n" + table + "\n"


def _run(inputs: CardInputs, name: str) -> str:
    chat = (
        '\nreply = engine.chat([{"role": "user", "content": "Hi!"}], params)[0].text  # the chat template\n'
        if inputs.chat
        else "\n"
    )
    wheel = inputs.files[inputs.wheel]
    tp = inputs.manifest.get("tp", 1)
    if tp > 1:
        return _run_sharded(inputs, name, tp, wheel)
    return (
        "## Run it with qruntime\n\n"
        f"In a copy of this folder (from the hub: `hf download REPO --local-dir {name}`), install the bundled "
        f"runtime (sha256 `{wheel['sha256']}`; pip installs its dependencies — torch, safetensors, onnx, "
        "tokenizers, jinja2 — unless they are there; on a CPU-only machine install torch from its CPU index "
        "first):\n\n"
        f"```\npip install {name}/{inputs.wheel}\n```\n\n"
        "```python\nimport qruntime\n\n"
        f'engine = qruntime.load("{name}")  # cuda when available, else cpu; verify=True checks every sha256\n'
        "params = qruntime.SamplingParams(max_tokens=64)  # greedy; temperature, top_p, top_k, seed to sample\n"
        'print(engine.generate("The capital of France is", params)[0].text)'
        f"{chat}```\n\n"
        f'or from the shell: `python -m qruntime run {name} "The capital of France is" --max-tokens 64`.\n\n'
        "## Serve it with vLLM\n\n"
        "`qcompile export` splits the fused tensors back into the source's names (losslessly: fusing never "
        "changes a row's bytes or its scale) and writes a compressed-tensors checkpoint that vLLM, SGLang and "
        "transformers load:\n\n"
        f"```\nqcompile export {name} --format compressed-tensors -o {name}-ct\nvllm serve {name}-ct\n```\n"
    )


def _run_sharded(inputs: CardInputs, name: str, tp: int, wheel: dict[str, Any]) -> str:
    return (
        "## Run it with qruntime\n\n"
        f"The weights are pre-sharded for {tp} GPUs of one host. In a copy of this folder (from the hub: "
        f"`hf download REPO --local-dir {name}`), install the bundled runtime (sha256 `{wheel['sha256']}`):\n\n"
        f"```\npip install {name}/{inputs.wheel}\n```\n\n"
        "```python\nimport qruntime\n\n"
        f'engine = qruntime.load("{name}", tp={tp})  # rank r on cuda:r, a worker process per GPU beyond the first\n'
        "params = qruntime.SamplingParams(max_tokens=64)\n"
        'print(engine.generate("The capital of France is", params)[0].text)\n```\n\n'
        "## Serve it with vLLM\n\n"
        "`qcompile export` reads unsharded (tp=1) artifacts: compile the source with `tp: 1` (below), export "
        "that to compressed-tensors and let vLLM shard it (`vllm serve DIR --tensor-parallel-size "
        f"{tp}`).\n"
    )


def _reproduce(inputs: CardInputs, name: str) -> str:
    m = inputs.manifest
    base = inputs.base_model
    source = base.rsplit("/", 1)[-1]
    calibrated = bool((m["kv_cache"].get("scales") or {}).get("calibrated"))
    download = f"hf download {base} --local-dir {source}\n" if _REPO_ID.fullmatch(base) else ""
    calib = " --calib CALIB.txt" if calibrated else ""
    note = (
        " The KV-cache scales were calibrated on a text that is not part of the artifact: another text gives "
        "other scales (the ones used are in manifest.json)."
        if calibrated
        else ""
    )
    recipe = yaml.safe_dump(m["recipe"], sort_keys=False, allow_unicode=True, width=1000)
    return (
        "## Reproduce\n\n"
        f"Save the resolved recipe below as `recipe.yaml` and compile the source checkpoint with it:\n\n"
        f"```\n{download}qcompile compile {source} -o {name} --recipe recipe.yaml{calib}\n```\n\n"
        f"```yaml\n{recipe}```\n\n"
        f"The source checkpoint's fingerprint (sha256 over config.json, the shard index and each shard's size "
        f"and sha256) is `{m['source']['fingerprint']}`; the new manifest.json records the fingerprint of the "
        f"checkpoint it was compiled from, to compare.{note}\n"
    )


def _files(inputs: CardInputs) -> str:
    lines = ["| file | bytes | sha256 |", "|---|---:|---|"]
    lines += [f"| `{p}` | {f['bytes']} | `{f['sha256']}` |" for p, f in sorted(inputs.files.items())]
    return (
        "## Files\n\n"
        "Every file but this card and manifest.json, which lists them all with the same sha256, this card "
        "included: `qcompile verify DIR` or `qruntime.load(DIR, verify=True)` checks them.\n\n"
        + "\n".join(lines)
        + "\n"
    )
