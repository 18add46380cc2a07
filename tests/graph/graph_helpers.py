"""Shared test data for the graph stage: small ModelSpecs, shipped recipes, weights written to disk."""

from __future__ import annotations

import dataclasses
import json
import struct
from collections import Counter
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from qcompile.graph import PASSES, Graph, TensorLocation
from qcompile.recipe.schema import KVCacheRecipe, Recipe, recipe_dir, recipe_from_dict
from qcompile.source.model import expected_tensors
from qcompile.source.spec import ModelSpec, MoESpec

PASS_NAMES = tuple(PASSES)  # every registered pass, in registry order (the recipes' order)
# every pass, in an order other than the recipes' (norms first), requirements still met
NORM_FIRST = (
    "fuse_add_rmsnorm_quant",
    "fuse_allreduce_add_rmsnorm",
    "fuse_qkv_proj",
    "fuse_moe_experts",
    "fuse_qknorm_rope_kvwrite",
    "fuse_gate_up_proj",
    "fuse_silu_mul_quant",
)
REQUIRES = {
    "fuse_silu_mul_quant": ("fuse_gate_up_proj",),
    "fuse_qknorm_rope_kvwrite": ("fuse_qkv_proj",),
    "fuse_allreduce_add_rmsnorm": ("fuse_add_rmsnorm_quant",),
}


def dense_spec(tied: bool = False, dtype: str = "bfloat16", **changes: object) -> ModelSpec:
    """Odd sizes on purpose: 6 heads over 3 KV heads, intermediate 72, vocab 97."""
    spec = ModelSpec(
        architecture="Qwen3ForCausalLM",
        dtype=dtype,
        vocab_size=97,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        intermediate_size=72,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    return dataclasses.replace(spec, **changes)


def moe_spec(tied: bool = False, dtype: str = "bfloat16", **changes: object) -> ModelSpec:
    """Three layers, the middle one dense through mlp_only_layers; 4 experts, top-2."""
    moe = MoESpec(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=40,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(1,),
    )
    spec = dataclasses.replace(
        dense_spec(tied, dtype), architecture="Qwen3MoeForCausalLM", num_hidden_layers=3, moe=moe
    )
    return dataclasses.replace(spec, **changes)


def aligned_spec(moe: bool = False) -> ModelSpec:
    """Every fused part a multiple of 128 rows, for block-fp8 with every pass on."""
    spec = dense_spec(
        hidden_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        intermediate_size=256,
        vocab_size=160,
    )
    if moe:
        spec = dataclasses.replace(
            spec,
            architecture="Qwen3MoeForCausalLM",
            num_hidden_layers=2,
            moe=MoESpec(
                num_experts=3,
                num_experts_per_tok=2,
                moe_intermediate_size=128,
                norm_topk_prob=False,
                decoder_sparse_step=2,
                mlp_only_layers=(),
            ),
        )
    return spec


def recipe(
    name: str, passes: tuple[str, ...] | None = None, ignore: tuple[str, ...] | None = None, **kv: object
) -> Recipe:
    """A shipped recipe (read without the llm-compressor translation), optionally with passes/ignore/kv changed."""
    raw = yaml.safe_load((recipe_dir() / f"{name}.yaml").read_text())
    loaded = recipe_from_dict(raw, source=name)
    if passes is not None:
        loaded = dataclasses.replace(loaded, passes=passes)
    if ignore is not None:
        loaded = dataclasses.replace(loaded, quantization=dataclasses.replace(loaded.quantization, ignore=ignore))
    if kv:
        loaded = dataclasses.replace(loaded, kv_cache=dataclasses.replace(loaded.kv_cache, **kv))
    return loaded


def with_prerequisites(name: str) -> tuple[str, ...]:
    return (*REQUIRES.get(name, ()), name)


def source_counts(graph: Graph) -> Counter[str]:
    return Counter(src for job in graph.weights.values() for src in job.source_names())


def random_sources(spec: ModelSpec, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Fresh random source tensors for every tensor of a checkpoint of `spec` (norms around 1)."""
    dtype = getattr(torch, spec.dtype)
    out = {}
    for name, shape in expected_tensors(spec).items():
        t = torch.randn(shape) * scale
        out[name] = (t + 1.0 if len(shape) == 1 else t).to(dtype)
    return out


Locations = dict[str, TensorLocation]


def write_weights(graph: Graph, root: Path, files: int = 2) -> tuple[Locations, dict[str, torch.Tensor]]:
    """Write random tensors for every weight the graph reads into `files` safetensors files under root/weights,
    and return their locations (absolute offsets read back from each file's header) and the tensors."""
    (root / "weights").mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in graph.weight_tensors.items():
        tensors[name] = (torch.randn(tuple(int(d) for d in t.shape)) * 2).to(t.dtype)
    names = sorted(tensors)
    locations = {}
    for i in range(files):
        rel = f"weights/model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::files]}
        save_file(part, str(root / rel))
        raw = (root / rel).read_bytes()
        (header_len,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + header_len])
        for n, entry in header.items():
            if n == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            offset = 8 + header_len + begin  # absolute: past the length prefix and the JSON header
            locations[n] = TensorLocation(rel, offset, end - begin, part[n].dtype, tuple(entry["shape"]))
    return locations, tensors


def kv(block_size: int = 4) -> KVCacheRecipe:
    return KVCacheRecipe(dtype="bf16", layout="nhd", block_size=block_size)
