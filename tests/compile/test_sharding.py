"""qcompile.compile.sharding: which slice of every tensor each tensor-parallel rank holds, and the PlanErrors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qcompile.compile.jobs import WeightJob
from qcompile.compile.sharding import Sharding, Split, check_tp, local_heads, source_splits
from qcompile.errors import PlanError
from qcompile.source.model import expected_tensors
from qcompile.source.spec import ModelSpec, MoESpec

SPEC = ModelSpec(
    architecture="Qwen3ForCausalLM",
    dtype="bfloat16",
    vocab_size=50,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=4,
    intermediate_size=48,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
QKV = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight")
QKV += ("model.layers.0.self_attn.v_proj.weight",)


def _job(name: str, sources: tuple[tuple[str, ...], ...], scheme: str = "ptpc-fp8", stacked: bool = False):
    return WeightJob(name, sources, stacked=stacked, scheme=scheme, role="linear")


def test_split_takes_spans_and_checks_them() -> None:
    whole = torch.arange(24).reshape(6, 4)
    split = Split(2, 0, (((0, 2), (4, 5)), ((2, 4), (5, 6))))
    assert split.shape((6, 4)) == (3, 4)
    assert split.take(whole, 1).tolist() == [[8, 9, 10, 11], [12, 13, 14, 15], [20, 21, 22, 23]]
    assert Split(2).take(whole, 1) is whole and Split(2).shape((6, 4)) == (6, 4)
    with pytest.raises(ValueError, match="equal"):
        Split(2, 0, (((0, 2),), ((2, 5),)))
    with pytest.raises(ValueError, match="spans for each"):
        Split(2, 0, (((0, 2),),))


@pytest.mark.parametrize(
    ("tp", "kv_rows"),
    [
        (2, [[(0, 4)], [(4, 8)]]),  # 2 KV heads split: one each
        (4, [[(0, 4)], [(0, 4)], [(4, 8)], [(4, 8)]]),  # replicated: KV head r * 2 // 4
        (8, [[(0, 4)]] * 4 + [[(4, 8)]] * 4),
    ],
)
def test_kv_heads_are_split_or_replicated(tp: int, kv_rows: list) -> None:
    splits = source_splits(SPEC, tp)
    q_axis, q = splits[QKV[0]]
    assert q_axis == 0 and [list(spans) for spans in q] == [[(r * 32 // tp, (r + 1) * 32 // tp)] for r in range(tp)]
    assert [list(spans) for spans in splits[QKV[1]][1]] == kv_rows == [list(s) for s in splits[QKV[2]][1]]
    assert local_heads(SPEC, tp) == (8 // tp, max(2 // tp, 1))
    # o_proj: the columns of the rank's query heads; the MLP by the intermediate dim
    assert splits["model.layers.0.self_attn.o_proj.weight"] == (1, q)
    assert splits["model.layers.0.mlp.down_proj.weight"][0] == 1
    assert splits["model.layers.0.mlp.gate_proj.weight"][1][1] == ((48 // tp, 2 * 48 // tp),)
    assert "model.layers.0.mlp.gate.weight" not in splits and "model.norm.weight" not in splits


def test_fused_qkv_holds_its_q_then_k_then_v_rows() -> None:
    shapes = expected_tensors(SPEC)
    job = _job("model.layers.0.self_attn.qkv_proj", (QKV,))
    splits = Sharding(SPEC, 4).splits(job, shapes)
    weight, scale = splits[job.weight_name], splits[job.scale_name]
    assert weight.axis == 0 and weight.ranks[3] == ((24, 32), (36, 40), (44, 48))
    assert scale == weight  # per-channel scales follow the rows
    assert weight.shape((48, 32)) == (16, 32)


def test_row_parallel_scales_stay_whole_and_block_scales_follow() -> None:
    spec = dataclasses.replace(SPEC, hidden_size=256, head_dim=128, num_attention_heads=2, num_key_value_heads=2)
    shapes = expected_tensors(spec)
    o_proj = ("model.layers.0.self_attn.o_proj.weight",)
    for scheme, scale_axis in (("ptpc-fp8", None), ("tensor-fp8", None), ("block-fp8", 1)):
        job = _job("model.layers.0.self_attn.o_proj", (o_proj,), scheme)
        splits = Sharding(spec, 2).splits(job, shapes)
        assert splits[job.weight_name] == Split(2, 1, (((0, 128),), ((128, 256),)))
        assert splits[job.scale_name].axis == scale_axis
    assert splits[job.scale_name] == Split(2, 1, (((0, 1),), ((1, 2),)))


def test_stacked_experts_split_inside_each_expert() -> None:
    moe = MoESpec(4, 2, 16, True, 1, ())
    spec = dataclasses.replace(SPEC, architecture="Qwen3MoeForCausalLM", moe=moe)
    shapes = expected_tensors(spec)
    prefix = "model.layers.0.mlp.experts"
    w13 = _job(f"{prefix}.w13", tuple((f"{prefix}.{e}.gate_proj.weight", f"{prefix}.{e}.up_proj.weight") for e in range(4)), stacked=True)  # fmt: skip
    w2 = _job(f"{prefix}.w2", tuple((f"{prefix}.{e}.down_proj.weight",) for e in range(4)), stacked=True)
    sharding = Sharding(spec, 2)
    assert sharding.splits(w13, shapes)[w13.weight_name] == Split(2, 1, (((0, 8), (16, 24)), ((8, 16), (24, 32))))
    w2_splits = sharding.splits(w2, shapes)
    assert w2_splits[w2.weight_name] == Split(2, 2, (((0, 8),), ((8, 16),)))
    assert w2_splits[w2.scale_name].replicated


def test_replicated_tensors() -> None:
    shapes = expected_tensors(SPEC)
    for job in (
        WeightJob("model.embed_tokens", (("model.embed_tokens.weight",),), False, "none", "embedding"),
        WeightJob("model.norm", (("model.norm.weight",),), False, "none", "norm"),
    ):
        assert all(split.replicated for split in Sharding(SPEC, 2).splits(job, shapes).values())


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_splits_by_vocabulary_rows_when_the_ranks_divide_it(tied: bool) -> None:
    """By its role, whatever it reads: an FP8 head made from tied embeddings splits too, while the
    embedding table it was made from stays whole."""
    source = "model.embed_tokens.weight" if tied else "lm_head.weight"
    job = WeightJob("lm_head", ((source,),), False, "ptpc-fp8", "lm_head")
    spec = dataclasses.replace(SPEC, vocab_size=64)
    vocab = spec.vocab_size
    for tp in (2, 4):
        splits = Sharding(spec, tp).splits(job, expected_tensors(spec))
        step = vocab // tp
        for split in splits.values():  # the weight and its per-row scale
            assert split.axis == 0 and split.ranks == tuple(((r * step, (r + 1) * step),) for r in range(tp))
    odd = dataclasses.replace(SPEC, vocab_size=50)  # not a multiple of 4: every rank holds the whole head
    assert all(s.replicated for s in Sharding(odd, 4).splits(job, expected_tensors(odd)).values())


def test_block_splits_off_the_grid_are_plan_errors() -> None:
    spec = dataclasses.replace(SPEC, hidden_size=256, head_dim=128, num_attention_heads=2, num_key_value_heads=2)
    shapes = expected_tensors(spec)
    job = _job("model.layers.0.mlp.down_proj", (("model.layers.0.mlp.down_proj.weight",),), "block-fp8")
    with pytest.raises(
        PlanError,
        match=r"tp=2: model.layers.0.mlp.down_proj.weight would be split between columns 23 and 24, inside a 128-wide",
    ):
        Sharding(spec, 2).splits(job, shapes)  # intermediate 48 over 2 ranks
    qkv = _job("model.layers.0.self_attn.qkv_proj", (tuple(QKV),), "block-fp8")
    Sharding(spec, 2).splits(qkv, shapes)  # 128-row heads: on the grid


@pytest.mark.parametrize(
    ("changes", "tp", "message"),
    [
        ({}, 16, "tp=16 is more than the model's num_attention_heads (8)"),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 6},
            4,
            "does not divide the model's num_attention_heads (6)",
        ),
        (
            {"num_key_value_heads": 6, "num_attention_heads": 12},
            4,
            "does not divide the model's num_key_value_heads (6)",
        ),
        ({"num_key_value_heads": 3, "num_attention_heads": 24}, 4, "num_key_value_heads (3) is fewer than the ranks"),
        ({"intermediate_size": 36}, 8, "does not divide the model's intermediate_size (36)"),
    ],
)
def test_models_that_do_not_split_name_the_key(changes: dict, tp: int, message: str) -> None:
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_tp(dataclasses.replace(SPEC, **changes), tp)


def test_moe_intermediate_counts_only_when_a_layer_is_sparse() -> None:
    moe = MoESpec(4, 2, 20, True, 1, ())
    sparse = dataclasses.replace(SPEC, architecture="Qwen3MoeForCausalLM", moe=moe, intermediate_size=30)
    with pytest.raises(PlanError, match=r"moe_intermediate_size \(20\)"):
        check_tp(sparse, 8)
    check_tp(sparse, 4)  # intermediate_size 30 is no layer's: not checked
    check_tp(SPEC, 1)
