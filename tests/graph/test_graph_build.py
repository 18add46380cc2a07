"""build_graph: the unfused decoder graph, its weight jobs and its validation of the recipe."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from graph_helpers import dense_spec, moe_spec, recipe, source_counts

from qcompile.errors import PlanError, RecipeError
from qcompile.graph import build_graph
from qcompile.graph.ops import FUSED_OPS, LINEAR_OPS, SIMPLE_OPS, STANDARD_OPS
from qcompile.quant import get_scheme
from qcompile.recipe.schema import recipe_from_dict
from qcompile.source.model import expected_tensors

SPECS = {
    "dense": dense_spec(),
    "dense-tied": dense_spec(tied=True),
    "moe": moe_spec(),
    "moe-tied": moe_spec(tied=True),
}
RECIPES = ("ptpc-fp8", "bf16", "block-fp8", "ptpc-fp8-lmhead", "ptpc-fp8-unfused")

OPS_INPUTS = [
    ("input_ids", torch.int64, ("T",)),
    ("positions", torch.int64, ("T",)),
    ("slot_mapping", torch.int64, ("T",)),
    ("block_tables", torch.int32, ("B", "max_blocks")),
    ("context_lens", torch.int32, ("B",)),
    ("query_start_loc", torch.int32, ("B+1",)),
    ("logits_indices", torch.int64, ("B",)),
]


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("spec_name", SPECS)
def test_unfused_graph_reads_every_source_tensor_once(spec_name: str, recipe_name: str) -> None:
    spec, rec = SPECS[spec_name], recipe(recipe_name)
    graph = build_graph(spec, rec)
    counts = source_counts(graph)
    assert set(counts) == set(expected_tensors(spec))
    head_quantized = get_scheme(rec.quantization.scheme).quantized and not rec.ignores("lm_head")
    tied_quantized_head = spec.tie_word_embeddings and head_quantized
    twice = {name for name, n in counts.items() if n > 1}
    assert twice == ({"model.embed_tokens.weight"} if tied_quantized_head else set())
    for job in graph.weights.values():
        assert not job.stacked
        assert job.sources == ((f"{job.name}.weight",),) or job.name == "lm_head"


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("spec_name", SPECS)
def test_unfused_graph_uses_only_unfused_ops_and_the_right_linear(spec_name: str, recipe_name: str) -> None:
    spec, rec = SPECS[spec_name], recipe(recipe_name)
    graph = build_graph(spec, rec)
    assert {op for _, op in graph.op_types()} <= STANDARD_OPS | SIMPLE_OPS
    assert not {op for _, op in graph.op_types()} & FUSED_OPS
    for node in graph.nodes:
        if node.op_type in LINEAR_OPS:
            weight = node.inputs[LINEAR_OPS[node.op_type]]
            job = graph.weights.get(weight.removesuffix(".weight"))
            scheme = job.quant if job is not None else get_scheme("none")  # tied head reads the embedding
            assert node.op_type == scheme.linear_op, node.name
            if job is not None and job.role in ("linear", "router", "lm_head"):
                expected = "none" if rec.ignores(job.name) else rec.quantization.scheme
                assert job.scheme == expected, job.name
    for job in graph.weights.values():
        if job.role in ("norm", "embedding"):
            assert job.scheme == "none"


def test_graph_inputs_and_output_follow_ops_md() -> None:
    graph = build_graph(dense_spec(dtype="float16"), recipe("ptpc-fp8"))
    assert [(n, graph.types[n].dtype, graph.types[n].shape) for n in graph.inputs] == OPS_INPUTS
    assert graph.outputs == ("logits",)
    assert graph.types["logits"].dtype == torch.float16
    assert graph.types["logits"].shape == ("B", 97)


def test_tied_unquantized_lm_head_reads_the_embedding_table() -> None:
    graph = build_graph(dense_spec(tied=True), recipe("ptpc-fp8"))
    assert "lm_head" not in graph.weights
    readers = [n for n in graph.nodes if "model.embed_tokens.weight" in n.inputs]
    assert [(n.op_type, n.name) for n in readers] == [("Gather", "model.embed_tokens"), ("Gemm", "lm_head")]


def test_tied_quantized_lm_head_is_its_own_job_from_the_embedding() -> None:
    graph = build_graph(dense_spec(tied=True), recipe("ptpc-fp8-lmhead"))
    head = graph.weights["lm_head"]
    assert (head.sources, head.role, head.scheme) == ((("model.embed_tokens.weight",),), "lm_head", "ptpc-fp8")
    assert graph.weights["model.embed_tokens"].scheme == "none"
    (node,) = [n for n in graph.nodes if n.name == "lm_head"]
    assert node.op_type == "PTPCLinear" and node.inputs[2:] == ("lm_head.weight", "lm_head.weight_scale")


def test_untied_lm_head_reads_lm_head_weight() -> None:
    graph = build_graph(dense_spec(), recipe("bf16"))
    assert graph.weights["lm_head"].sources == (("lm_head.weight",),)
    assert graph.weights["lm_head"].role == "lm_head"


def test_attention_attributes() -> None:
    spec = dense_spec()
    rec = recipe("ptpc-fp8", layout="hnd", block_size=32)
    graph = build_graph(spec, rec)
    attn = [n for n in graph.nodes if n.op_type == "PagedAttention"]
    writes = [n for n in graph.nodes if n.op_type == "KVCacheWrite"]
    assert [n.attrs["layer"] for n in attn] == [n.attrs["layer"] for n in writes] == [0, 1]
    kv = {"layout": "hnd", "block_size": 32, "kv_dtype": "bf16", "k_scale": 1.0, "v_scale": 1.0}
    for node in attn:
        assert dict(node.attrs) == {
            **kv,
            "layer": node.attrs["layer"],
            "num_heads": 6,
            "num_kv_heads": 3,
            "head_dim": 16,
            "scale": 16**-0.5,
        }
        assert node.inputs[2:] == ("block_tables", "context_lens", "query_start_loc")
    for node in writes:
        assert dict(node.attrs) == {**kv, "layer": node.attrs["layer"]}
        assert node.inputs[2] == "slot_mapping"
    ropes = [n for n in graph.nodes if n.op_type == "RoPE"]
    assert len(ropes) == 4 and all(dict(n.attrs) == {"theta": 1e6, "head_dim": 16} for n in ropes)
    norms = [n for n in graph.nodes if n.op_type == "RMSNormalization"]
    assert len(norms) == 4 * spec.num_hidden_layers + 1
    assert all(dict(n.attrs) == {"axis": -1, "epsilon": 1e-6} for n in norms)


def test_moe_layers_follow_is_sparse_layer_and_sum_experts_in_order() -> None:
    spec = moe_spec()
    graph = build_graph(spec, recipe("ptpc-fp8"))
    routing = [n for n in graph.nodes if n.op_type == "MoERouting"]
    assert [n.name for n in routing] == ["layers.0.mlp.routing", "layers.2.mlp.routing"]
    assert all(dict(n.attrs) == {"top_k": 2, "norm_topk_prob": 1} for n in routing)
    assert "model.layers.1.mlp.gate_proj" in graph.weights and "model.layers.0.mlp.gate_proj" not in graph.weights
    assert graph.weights["model.layers.0.mlp.gate"].role == "router"
    assert graph.weights["model.layers.0.mlp.gate"].scheme == "none"
    experts = [n.attrs["expert"] for n in graph.nodes if n.op_type == "ExpertWeight"]
    assert experts == [0, 1, 2, 3] * 2
    # the running sum: layer 0's output is ((e0 + e1) + e2) + e3
    producers = {out: n for n in graph.nodes for out in n.outputs}
    chain, value = [], "layers.0.mlp_out"
    while producers[value].op_type == "Add":
        chain.append(producers[value].inputs[1])
        value = producers[value].inputs[0]
    assert value == "layers.0.mlp.experts.0.weighted"
    assert chain == [f"layers.0.mlp.experts.{e}.weighted" for e in (3, 2, 1)]


def test_mixed_schemes_share_one_dynamic_quant_per_input() -> None:
    rec = recipe("ptpc-fp8", ignore=("lm_head", "re:.*k_proj$"))
    graph = build_graph(dense_spec(), rec)
    by_name = {n.name: n for n in graph.nodes}
    assert by_name["model.layers.0.self_attn.k_proj"].op_type == "Gemm"
    assert by_name["model.layers.0.self_attn.k_proj"].inputs[0] == "layers.0.attn_norm"
    q, v = by_name["model.layers.0.self_attn.q_proj"], by_name["model.layers.0.self_attn.v_proj"]
    assert q.inputs[:2] == v.inputs[:2] == ("layers.0.attn_norm.q", "layers.0.attn_norm.scale")
    quants = [n for n in graph.nodes if n.op_type == "DynamicQuant" and n.inputs == ("layers.0.attn_norm",)]
    assert len(quants) == 1


def test_block_fp8_linear_carries_block_sizes_and_group_quant() -> None:
    graph = build_graph(dense_spec(), recipe("block-fp8"))
    linears = [n for n in graph.nodes if n.op_type == "BlockFP8Linear"]
    assert linears and all(dict(n.attrs) == {"block_n": 128, "block_k": 128} for n in linears)
    quants = [n for n in graph.nodes if n.op_type == "DynamicQuant"]
    assert quants and all(n.attrs["group_size"] == 128 for n in quants)
    assert graph.types["layers.0.mlp.act.scale"].shape == ("T", 1)  # 72 channels: one group of 128


def test_kv_layout_that_does_not_fit_the_head_dim_is_a_plan_error() -> None:
    spec = dense_spec(head_dim=12)
    with pytest.raises(PlanError, match="x-packed.*head_dim"):
        build_graph(spec, recipe("ptpc-fp8", layout="x-packed", block_size=16))
    build_graph(spec, recipe("ptpc-fp8", layout="nhd", block_size=16))  # the same model fits nhd


def test_tp_sizes_that_do_not_divide_are_named() -> None:
    rec = dataclasses.replace(recipe("ptpc-fp8"), tp=2)
    with pytest.raises(PlanError, match="num_key_value_heads"):
        build_graph(dense_spec(), rec)  # 3 KV heads


def test_tp_above_one_builds_each_ranks_graph() -> None:
    """tp=2 of 4 query / 2 KV heads: each rank's graph has 2 / 1 heads, its share of the MLP, and an
    AllReduce after each row-parallel output (tests/graph/test_graph_tp.py covers the rest)."""
    rec = dataclasses.replace(recipe("ptpc-fp8"), tp=2)
    graph = build_graph(dense_spec(num_key_value_heads=2, num_attention_heads=4), rec)
    assert graph.tp == 2 and graph.metadata["tp"] == "2"
    assert sum(n.op_type == "AllReduce" for n in graph.nodes) == 2 * graph.spec.num_hidden_layers
    attn = next(n for n in graph.nodes if n.op_type == "PagedAttention")
    assert (attn.attrs["num_heads"], attn.attrs["num_kv_heads"]) == (2, 1)
    assert graph.types["layers.0.mlp.gate"].shape == ("T", 36)


def test_unknown_scheme_is_refused_before_the_graph() -> None:
    """Recipe values are validated where recipes are made, so no graph is built from one."""
    with pytest.raises(RecipeError, match="quantization.scheme 'int4' is unknown"):
        recipe_from_dict({"quantization": {"scheme": "int4"}})


def test_fp8_kv_cache_reaches_the_cache_ops_and_unknown_kv_dtypes_are_refused() -> None:
    graph = build_graph(dense_spec(), recipe("ptpc-fp8", dtype="fp8_e4m3"))
    kv_ops = [n for n in graph.nodes if n.op_type in ("KVCacheWrite", "PagedAttention")]
    assert len(kv_ops) == 4 and all(n.attrs["kv_dtype"] == "fp8_e4m3" for n in kv_ops)
    with pytest.raises(RecipeError, match="kv_cache.dtype 'fp16'"):
        recipe_from_dict({"kv_cache": {"dtype": "fp16"}})
