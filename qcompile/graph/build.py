"""build_graph: the unfused decoder graph of a ModelSpec under a Recipe (docs/OPS.md)."""

from __future__ import annotations

import torch
from qruntime.kv_layout import KV_LAYOUTS

from qcompile.compile.kvcache import KVScales
from qcompile.compile.sharding import check_tp, vocab_parallel
from qcompile.errors import PlanError
from qcompile.graph.builder import GraphBuilder
from qcompile.graph.image_rows import POSITIONS_SHAPE, check_vision, scatter_rows, vision_inputs
from qcompile.graph.ir import Graph
from qcompile.graph.layers import attention, dense_mlp, sparse_moe
from qcompile.recipe.schema import Recipe
from qcompile.source import model as hf
from qcompile.source.spec import ModelSpec

# name, dtype, shape of the graph inputs, in the order of docs/OPS.md
GRAPH_INPUTS = (
    ("input_ids", torch.int64, ("T",)),
    ("positions", torch.int64, ("T",)),
    ("slot_mapping", torch.int64, ("T",)),
    ("block_tables", torch.int32, ("B", "max_blocks")),
    ("context_lens", torch.int32, ("B",)),
    ("query_start_loc", torch.int32, ("B+1",)),
    ("logits_indices", torch.int64, ("B",)),
)
LOGITS = "logits"


def build_graph(spec: ModelSpec, recipe: Recipe, kv_scales: KVScales | None = None) -> Graph:
    """The unfused graph: one op per step of the math, every weight under its source (HF) name.

    Raises PlanError when the recipe cannot be applied to this model (KV layout constraints, an unknown
    scheme, a tensor-parallel degree the model does not divide by). At tp > 1 it is the graph of every
    rank: each rank's share of the heads and intermediate dims, an AllReduce after each row-parallel
    output (qcompile.compile.sharding). A Qwen3-VL model (`spec.vision`) takes M-RoPE positions [3, T]
    and the image rows' embeddings and DeepStack features (qcompile.graph.image_rows).
    """
    check_plan(spec, recipe)
    b = GraphBuilder(spec, recipe, kv_scales)
    for name, dtype, shape in GRAPH_INPUTS:
        b.input(name, dtype, POSITIONS_SHAPE if name == "positions" and spec.vision else shape)
    image, features = vision_inputs(b) if spec.vision else ("", ())
    embed = b.job(hf.EMBED, ((f"{hf.EMBED}.weight",),), "none", "embedding")
    (hidden,) = b.node(
        "Gather",
        [embed.weight_name, "input_ids"],
        [b.act("embeds", ("T", spec.hidden_size))],
        {"axis": 0},
        name=hf.EMBED,
    )
    if spec.vision:
        hidden = scatter_rows(b, hidden, image, "embeds.merged", "none")
    for i in range(spec.num_hidden_layers):
        p = f"layers.{i}."
        x = b.rms_norm(hidden, hf.norm(i, "input_layernorm"), p + "attn_norm")
        h = b.binary("Add", attention(b, i, x), hidden, p + "attn_residual")
        x = b.rms_norm(h, hf.norm(i, "post_attention_layernorm"), p + "mlp_norm")
        mlp = sparse_moe if spec.is_sparse_layer(i) else dense_mlp
        hidden = b.binary("Add", mlp(b, i, x, p + "mlp_out"), h, p + "hidden")
        if i < len(features):
            hidden = scatter_rows(b, hidden, features[i], p + "hidden.deepstack", "add")
    normed = b.rms_norm(hidden, hf.FINAL_NORM, "final_norm")
    (rows,) = b.node(
        "Gather",
        [normed, "logits_indices"],
        [b.act("final_norm.rows", ("B", spec.hidden_size))],
        {"axis": 0},
        name="select_logits_rows",
    )
    _lm_head(b, rows)
    metadata = {
        "architecture": spec.architecture,
        "recipe": recipe.name,
        "quantization": recipe.quantization.scheme,
        "kv_cache": f"{recipe.kv_cache.layout}/{recipe.kv_cache.dtype}/block_size={recipe.kv_cache.block_size}",
    }
    if recipe.tp > 1:
        metadata["tp"] = str(recipe.tp)
    if spec.vision:
        metadata["vision"] = f"mrope_section={list(spec.vision.mrope_section)}/deepstack_layers={len(features)}"
    return b.finish([LOGITS], metadata)


def _lm_head(b: GraphBuilder, rows: str) -> None:
    """logits [B,V]; a tied unquantized head reads the embedding table itself (stored once). At tp > 1
    a head of its own is vocabulary-parallel (sharding.vocab_parallel): each rank computes its V/tp
    columns of the logits and an AllGather puts the rows together, so no rank reads the whole head."""
    spec = b.spec
    tied = spec.tie_word_embeddings
    if tied and not b.scheme_of(hf.LM_HEAD).quantized:
        b.gemm(rows, f"{hf.EMBED}.weight", spec.vocab_size, LOGITS, name=hf.LM_HEAD)
        return
    source = f"{hf.EMBED}.weight" if tied else f"{hf.LM_HEAD}.weight"
    if not vocab_parallel(spec, b.tp):
        b.linear(rows, hf.LM_HEAD, spec.vocab_size, LOGITS, role="lm_head", source=source)
        return
    local = b.linear(rows, hf.LM_HEAD, spec.vocab_size // b.tp, f"{LOGITS}.local", role="lm_head", source=source)
    b.all_gather(local, LOGITS)


def check_plan(spec: ModelSpec, recipe: Recipe) -> None:
    """Raise PlanError when `recipe` cannot be applied to `spec`, naming the recipe key to change.

    Only what depends on the model is checked here; the recipe's own values (known scheme, KV
    dtype and layout names) were validated when it was loaded (qcompile.recipe.schema).
    """
    kv = recipe.kv_cache
    try:
        KV_LAYOUTS[kv.layout].check(kv.block_size, spec.head_dim, kv.dtype)
    except ValueError as exc:
        raise PlanError(
            f"recipe {recipe.name!r}: kv_cache (layout={kv.layout}, dtype={kv.dtype}, block_size={kv.block_size}) "
            f"does not fit this model: {exc}; choose another kv_cache.layout or block_size"
        ) from exc
    _check_ignore(spec, recipe)
    _check_tp(spec, recipe)
    check_vision(spec, recipe)


def _check_ignore(spec: ModelSpec, recipe: Recipe) -> None:
    """An exact module name in quantization.ignore that names no linear layer is a typo, not a no-op
    (regex entries may match nothing: the default router pattern on a dense model)."""
    linears = {n.removesuffix(".weight") for n, shape in hf.expected_tensors(spec).items() if len(shape) == 2}
    linears = (linears - {hf.EMBED}) | {hf.LM_HEAD}
    for entry in recipe.quantization.ignore:
        if not entry.startswith("re:") and entry not in linears:
            raise PlanError(
                f"recipe {recipe.name!r}: quantization.ignore entry {entry!r} names no linear layer of this "
                f"{spec.architecture} (e.g. {hf.attn_proj(0, 'o_proj')!r}); use an exact module name or 're:<regex>'"
            )


def _check_tp(spec: ModelSpec, recipe: Recipe) -> None:
    """The model must split `recipe.tp` ways: heads, KV heads (split or evenly replicated), intermediate sizes."""
    check_tp(spec, recipe.tp)
