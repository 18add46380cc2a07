"""The fusion passes: structure of the fused graph, weight coverage, requirements and PlanErrors."""

from __future__ import annotations

import pytest
from graph_helpers import (
    NORM_FIRST,
    PASS_NAMES,
    aligned_spec,
    dense_spec,
    moe_spec,
    recipe,
    source_counts,
    with_prerequisites,
)

from qcompile.errors import PlanError
from qcompile.graph import PASSES, Graph, apply_passes, build_graph, compile_graph
from qcompile.graph.ops import FUSED_OPS, OP_DOMAINS
from qcompile.recipe.schema import DEFAULT_PASSES
from qcompile.source.model import expected_tensors
from qcompile.source.spec import ModelSpec

PASS_SETS = {
    "all": PASS_NAMES,
    "none": (),
    "norm-first": NORM_FIRST,
    **{name: with_prerequisites(name) for name in PASS_NAMES},
}
CASES = [
    (spec_name, recipe_name, passes)
    for spec_name in ("dense", "dense-tied", "moe")
    for recipe_name in ("ptpc-fp8", "bf16", "ptpc-fp8-lmhead")
    for passes in PASS_SETS
] + [(spec_name, "block-fp8", passes) for spec_name in ("aligned", "aligned-moe") for passes in PASS_SETS]
SPECS = {
    "dense": dense_spec(),
    "dense-tied": dense_spec(tied=True),
    "moe": moe_spec(),
    "aligned": aligned_spec(),
    "aligned-moe": aligned_spec(moe=True),
}


def _count(graph: Graph, op_type: str) -> int:
    return sum(node.op_type == op_type for node in graph.nodes)


def _hidden_norms(graph: Graph) -> int:
    return sum(n.op_type == "RMSNormalization" and len(graph.types[n.inputs[0]].shape) == 2 for n in graph.nodes)


@pytest.mark.parametrize(("spec_name", "recipe_name", "passes"), CASES)
def test_fused_graph_covers_every_source_and_leaves_no_unfused_pattern(
    spec_name: str, recipe_name: str, passes: str
) -> None:
    spec, names = SPECS[spec_name], PASS_SETS[passes]
    graph = compile_graph(spec, recipe(recipe_name, passes=names))
    assert graph.applied_passes == names
    assert set(source_counts(graph)) == set(expected_tensors(spec))
    for job in graph.weights.values():
        job.weight_shape(expected_tensors(spec))  # parts of a fused job have compatible shapes
    assert all(OP_DOMAINS[node.op_type] == node.domain for node in graph.nodes)
    layers = spec.num_hidden_layers
    sparse = [i for i in range(layers) if spec.is_sparse_layer(i)]
    dense = [i for i in range(layers) if not spec.is_sparse_layer(i)]
    experts = spec.moe.num_experts if spec.moe else 0
    used_fused = {op for _, op in graph.op_types()} & FUSED_OPS
    expected_fused = set()
    if "fuse_qkv_proj" in names:
        assert not [j for j in graph.weights if j.endswith((".q_proj", ".k_proj", ".v_proj"))]
        assert [j for j in graph.weights if j.endswith("qkv_proj")] == [
            f"model.layers.{i}.self_attn.qkv_proj" for i in range(layers)
        ]
    if "fuse_gate_up_proj" in names:
        assert not [j for j in graph.weights if j.endswith(("mlp.gate_proj", "mlp.up_proj"))]
        assert sorted(j for j in graph.weights if j.endswith("gate_up_proj")) == [
            f"model.layers.{i}.mlp.gate_up_proj" for i in dense
        ]
    if "fuse_moe_experts" in names:
        assert _count(graph, "MoERouting") == _count(graph, "ExpertWeight") == 0
        assert _count(graph, "MoE") == len(sparse)
        assert not [j for j in graph.weights if ".experts." in j and not j.endswith((".w13", ".w2"))]
        expected_fused |= {"MoE"} if sparse else set()
    else:
        assert _count(graph, "ExpertWeight") == experts * len(sparse)
    if "fuse_add_rmsnorm_quant" in names:
        assert _hidden_norms(graph) == 0
        assert _count(graph, "AddRMSNorm") + _count(graph, "AddRMSNormQuant") == 2 * layers + 1
        assert _count(graph, "Add") == (0 if "fuse_moe_experts" in names else (experts - 1) * len(sparse))
        expected_fused |= {"AddRMSNorm", "AddRMSNormQuant"} & {op for _, op in graph.op_types()}
        assert "AddRMSNorm" in used_fused  # the final norm feeds a Gather
    if "fuse_silu_mul_quant" in names:
        unfused_experts = 0 if "fuse_moe_experts" in names else experts * len(sparse)
        assert _count(graph, "Sigmoid") == unfused_experts
        assert _count(graph, "SiluMul") + _count(graph, "SiluMulQuant") == len(dense)
        expected_fused |= {"SiluMul", "SiluMulQuant"} & {op for _, op in graph.op_types()}
    if "fuse_qknorm_rope_kvwrite" in names:
        for op in ("KVCacheWrite", "RoPE", "Reshape"):
            assert _count(graph, op) == 0
        assert _count(graph, "RMSNormalization") == (layers * 2 + 1 if "fuse_add_rmsnorm_quant" not in names else 0)
        assert _count(graph, "QKNormRoPEKVWrite") == layers
        expected_fused.add("QKNormRoPEKVWrite")
    assert used_fused == expected_fused
    if not names:
        assert not used_fused


def test_quantized_norms_and_silu_fold_their_dynamic_quant() -> None:
    graph = compile_graph(dense_spec(), recipe("ptpc-fp8"))
    assert _count(graph, "AddRMSNormQuant") == 4 and _count(graph, "AddRMSNorm") == 1  # final norm: Gather next
    assert _count(graph, "SiluMulQuant") == 2 and _count(graph, "SiluMul") == 0
    # left: the quantization of the attention output before o_proj, one per layer
    assert _count(graph, "DynamicQuant") == 2
    first = graph.nodes[1]
    assert (first.op_type, first.inputs[:2]) == ("AddRMSNormQuant", ("embeds", ""))
    # the residual stream runs through the fused ops: layer 0's residual add reads the first one's residual_out
    second = next(n for n in graph.nodes if n.name == "model.layers.0.post_attention_layernorm")
    assert second.inputs[1] == first.outputs[-1]


def test_fused_weight_jobs_list_their_parts_in_order() -> None:
    spec = moe_spec()
    graph = compile_graph(spec, recipe("ptpc-fp8"))
    qkv = graph.weights["model.layers.0.self_attn.qkv_proj"]
    assert qkv.sources == (tuple(f"model.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")),)
    gate_up = graph.weights["model.layers.1.mlp.gate_up_proj"]
    assert gate_up.sources == (("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"),)
    w13, w2 = graph.weights["model.layers.2.mlp.experts.w13"], graph.weights["model.layers.2.mlp.experts.w2"]
    assert w13.stacked and w2.stacked and w13.scheme == w2.scheme == "ptpc-fp8"
    assert w13.sources == tuple(
        (f"model.layers.2.mlp.experts.{e}.gate_proj.weight", f"model.layers.2.mlp.experts.{e}.up_proj.weight")
        for e in range(4)
    )
    assert w2.sources == tuple((f"model.layers.2.mlp.experts.{e}.down_proj.weight",) for e in range(4))
    shapes = expected_tensors(spec)
    assert w13.weight_shape(shapes) == (4, 80, 48) and w2.weight_shape(shapes) == (4, 48, 40)
    (moe,) = [n for n in graph.nodes if n.op_type == "MoE" and n.name == "model.layers.2.mlp"]
    assert moe.inputs == (
        "layers.2.mlp_norm",
        "model.layers.2.mlp.gate.weight",
        "model.layers.2.mlp.experts.w13.weight",
        "model.layers.2.mlp.experts.w13.weight_scale",
        "model.layers.2.mlp.experts.w2.weight",
        "model.layers.2.mlp.experts.w2.weight_scale",
    )
    assert dict(moe.attrs) == {
        "num_experts": 4,
        "top_k": 2,
        "norm_topk_prob": 1,
        "linear": "PTPCLinear",
        "group_size": 0,
    }
    # the fused jobs take the place of their parts in the writing order
    names = list(graph.weights)
    assert names.index("model.layers.0.self_attn.qkv_proj") < names.index("model.layers.0.self_attn.o_proj")


def test_moe_attributes_for_unquantized_and_block_experts() -> None:
    bf16 = compile_graph(moe_spec(), recipe("bf16"))
    moe = next(n for n in bf16.nodes if n.op_type == "MoE")
    assert moe.inputs[3] == moe.inputs[5] == ""
    assert (moe.attrs["linear"], moe.attrs["group_size"]) == ("Gemm", 0)
    block = compile_graph(aligned_spec(moe=True), recipe("block-fp8"))
    moe = next(n for n in block.nodes if n.op_type == "MoE")
    assert dict(moe.attrs) == {
        "num_experts": 3,
        "top_k": 2,
        "norm_topk_prob": 0,
        "linear": "BlockFP8Linear",
        "group_size": 128,
        "block_n": 128,
        "block_k": 128,
    }


def test_qknorm_rope_kvwrite_attributes() -> None:
    graph = compile_graph(dense_spec(), recipe("ptpc-fp8", layout="hnd", block_size=32))
    node = next(n for n in graph.nodes if n.op_type == "QKNormRoPEKVWrite")
    assert dict(node.attrs) == {
        "layer": 0,
        "layout": "hnd",
        "block_size": 32,
        "kv_dtype": "bf16",
        "k_scale": 1.0,
        "v_scale": 1.0,
        "num_heads": 6,
        "num_kv_heads": 3,
        "head_dim": 16,
        "epsilon": 1e-6,
        "theta": 1e6,
    }
    assert node.inputs == (
        "layers.0.qkv",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
        "positions",
        "slot_mapping",
    )
    assert graph.types["layers.0.qkv"].shape == ("T", 6 * 16 + 2 * 3 * 16)


def test_registry_is_read_only_and_names_the_recipe_passes() -> None:
    assert tuple(PASSES) == DEFAULT_PASSES == PASS_NAMES
    with pytest.raises(TypeError):
        PASSES["mine"] = PASSES["fuse_qkv_proj"]  # type: ignore[index]
    assert PASSES["fuse_silu_mul_quant"].requires == ("fuse_gate_up_proj",)
    assert PASSES["fuse_qknorm_rope_kvwrite"].requires == ("fuse_qkv_proj",)
    assert all(p.summary for p in PASSES.values())


@pytest.mark.parametrize(
    ("names", "needed"),
    [
        (("fuse_silu_mul_quant",), "fuse_gate_up_proj"),
        (("fuse_qknorm_rope_kvwrite",), "fuse_qkv_proj"),
        (("fuse_silu_mul_quant", "fuse_gate_up_proj"), "fuse_gate_up_proj"),
        (("fuse_qknorm_rope_kvwrite", "fuse_qkv_proj"), "fuse_qkv_proj"),
    ],
)
def test_a_pass_before_its_requirement_is_a_plan_error(names: tuple[str, ...], needed: str) -> None:
    graph = build_graph(dense_spec(), recipe("ptpc-fp8"))
    with pytest.raises(PlanError, match=f"{names[0]}.*{needed}"):
        apply_passes(graph, names)


def test_unknown_and_repeated_passes_are_plan_errors() -> None:
    graph = build_graph(dense_spec(), recipe("ptpc-fp8"))
    with pytest.raises(PlanError, match="fuse_everything"):
        apply_passes(graph, ["fuse_everything"])
    with pytest.raises(PlanError, match="fuse_qkv_proj.*twice"):
        apply_passes(apply_passes(graph, ["fuse_qkv_proj"]), ["fuse_qkv_proj"])


@pytest.mark.parametrize(
    ("spec", "ignore", "names", "modules"),
    [
        (dense_spec(), ("lm_head", "re:.*k_proj$"), ("fuse_qkv_proj",), "k_proj"),
        (dense_spec(), ("lm_head", "re:.*layers.1.mlp.up_proj$"), ("fuse_gate_up_proj",), "up_proj"),
        (moe_spec(), ("lm_head", "re:.*mlp.gate$", "re:.*experts.3.down_proj$"), ("fuse_moe_experts",), "down_proj"),
    ],
)
def test_fusing_parts_with_different_schemes_is_a_plan_error(
    spec: ModelSpec, ignore: tuple[str, ...], names: tuple[str, ...], modules: str
) -> None:
    graph = build_graph(spec, recipe("ptpc-fp8", ignore=ignore))
    with pytest.raises(PlanError, match=f"{names[0]}.*layer .*different quantization schemes.*{modules}") as err:
        apply_passes(graph, names)
    assert "quantization.ignore" in str(err.value) and "remove" in str(err.value).lower()


def test_a_quantized_router_cannot_become_a_moe_node() -> None:
    graph = build_graph(moe_spec(), recipe("ptpc-fp8", ignore=("lm_head",)))
    with pytest.raises(PlanError, match=r"fuse_moe_experts.*layer 0.*model.layers.0.mlp.gate.*ignore"):
        apply_passes(graph, ["fuse_moe_experts"])


@pytest.mark.parametrize(
    ("spec", "name", "part"),
    [
        (dense_spec(), "fuse_qkv_proj", "q_proj"),  # 96 rows
        (dense_spec(), "fuse_gate_up_proj", "gate_proj"),  # 72 rows
        (moe_spec(), "fuse_moe_experts", "experts.0.gate_proj"),  # 40 rows
    ],
)
def test_block_fp8_parts_off_the_block_grid_are_plan_errors(spec: ModelSpec, name: str, part: str) -> None:
    graph = build_graph(spec, recipe("block-fp8"))  # unfused, the same model compiles
    with pytest.raises(PlanError, match=f"{name}.*layer 0.*{part}.*not a multiple of the 128-row"):
        apply_passes(graph, [name])


def test_a_pass_with_nothing_to_fuse_is_a_recorded_no_op() -> None:
    graph = build_graph(dense_spec(), recipe("ptpc-fp8"))
    after = apply_passes(graph, ["fuse_moe_experts"])
    assert after.nodes == graph.nodes and dict(after.weights) == dict(graph.weights)
    assert after.applied_passes == ("fuse_moe_experts",)


def test_passes_do_not_modify_their_input() -> None:
    graph = build_graph(moe_spec(), recipe("ptpc-fp8"))
    nodes, weights, types = graph.nodes, dict(graph.weights), dict(graph.types)
    fused = apply_passes(graph, PASS_NAMES)
    assert graph.nodes == nodes and dict(graph.weights) == weights and dict(graph.types) == types
    assert fused.nodes != nodes and graph.applied_passes == ()
