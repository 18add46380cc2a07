"""The unfused blocks of one decoder layer (docs/OPS.md): attention, dense MLP, sparse MoE MLP.

At tp > 1 each block is one rank's share (qcompile.compile.sharding): its query / KV heads and its slice of
the intermediate dim, and the row-parallel output (o_proj, down_proj, the MoE sum) is a partial sum
all-reduced over the ranks.
"""

from __future__ import annotations

import torch

from qcompile.compile.sharding import local_heads
from qcompile.graph.builder import GraphBuilder
from qcompile.graph.image_rows import mrope_attrs
from qcompile.source import model as hf

KV_READY = torch.uint8


def kv_attrs(b: GraphBuilder, layer: int) -> dict[str, int | float | str]:
    """The KV-cache attributes every op that writes or reads layer `layer`'s cache carries."""
    kv, scales = b.recipe.kv_cache, b.kv_scales
    return {
        "layer": layer,
        "layout": kv.layout,
        "block_size": kv.block_size,
        "kv_dtype": kv.dtype,
        "k_scale": scales.k_scale[layer] if scales is not None else 1.0,
        "v_scale": scales.v_scale[layer] if scales is not None else 1.0,
    }


def attention(b: GraphBuilder, layer: int, x: str) -> str:
    """q/k/v projections, per-head q/k norm, RoPE, cache write, paged attention, o_proj. x [T,H] -> [T,H]."""
    spec, p = b.spec, f"layers.{layer}."
    (nh, kvh), d = local_heads(spec, b.tp), spec.head_dim
    rows = b.shape(x)[0]
    q = b.linear(x, hf.attn_proj(layer, "q_proj"), nh * d, p + "q")  # [T, nh*d]
    k = b.linear(x, hf.attn_proj(layer, "k_proj"), kvh * d, p + "k")  # [T, kvh*d]
    v = b.linear(x, hf.attn_proj(layer, "v_proj"), kvh * d, p + "v")
    heads = {}
    for name, value, count in (("q", q, nh), ("k", k, kvh), ("v", v, kvh)):
        shape = b.constant([-1, count, d])
        heads[name] = b.node("Reshape", [value, shape], [b.act(f"{p}{name}_heads", (rows, count, d))])[0]
    rotated = {}
    for name in ("q", "k"):
        normed = b.rms_norm(heads[name], hf.norm(layer, f"self_attn.{name}_norm"), f"{p}{name}_normed")
        rotated[name] = b.node(
            "RoPE",
            [normed, "positions"],
            [b.act(f"{p}{name}_rope", b.shape(normed))],
            {"theta": spec.rope_theta, "head_dim": d, **mrope_attrs(spec)},
        )[0]
    (ready,) = b.node(
        "KVCacheWrite",
        [rotated["k"], heads["v"], "slot_mapping"],
        [b.act(p + "kv_ready", (0,), KV_READY)],
        kv_attrs(b, layer),
        name=p + "kv_write",
    )
    (o,) = b.node(
        "PagedAttention",
        [rotated["q"], ready, "block_tables", "context_lens", "query_start_loc"],
        [b.act(p + "attn", (rows, nh * d))],
        {**kv_attrs(b, layer), "num_heads": nh, "num_kv_heads": kvh, "head_dim": d, "scale": d**-0.5},
    )
    out = p + "attn_out"
    return b.all_reduce(b.linear(o, hf.attn_proj(layer, "o_proj"), spec.hidden_size, b.partial(out)), out)


def silu_mul(b: GraphBuilder, gate: str, up: str, prefix: str) -> str:
    """gate * Sigmoid(gate) * up."""
    sig = b.node("Sigmoid", [gate], [b.act(prefix + "gate_sigmoid", b.shape(gate))])[0]
    silu = b.binary("Mul", gate, sig, prefix + "gate_silu")
    return b.binary("Mul", silu, up, prefix + "act")


def dense_mlp(b: GraphBuilder, layer: int, x: str, out: str) -> str:
    """down(silu(gate(x)) * up(x)). x [T,H] -> out [T,H]."""
    spec, p = b.spec, f"layers.{layer}.mlp."
    inter = spec.intermediate_size // b.tp
    gate = b.linear(x, hf.mlp_proj(layer, "gate_proj"), inter, p + "gate")
    up = b.linear(x, hf.mlp_proj(layer, "up_proj"), inter, p + "up")
    act = silu_mul(b, gate, up, p)
    return b.all_reduce(b.linear(act, hf.mlp_proj(layer, "down_proj"), spec.hidden_size, b.partial(out)), out)


def sparse_moe(b: GraphBuilder, layer: int, x: str, out: str) -> str:
    """Router, top-k routing, then every expert on all tokens weighted by its routing weight, summed in
    expert order. x [T,H] -> out [T,H]."""
    spec, p = b.spec, f"layers.{layer}.mlp."
    moe = spec.moe
    assert moe is not None, "sparse_moe called on a dense model"
    rows, k = b.shape(x)[0], moe.num_experts_per_tok
    inter, partial = moe.moe_intermediate_size // b.tp, b.partial(out)
    logits = b.linear(x, hf.router(layer), moe.num_experts, p + "router_logits", role="router")
    weights, ids = b.node(
        "MoERouting",
        [logits],
        [b.act(p + "topk_weights", (rows, k)), b.act(p + "topk_ids", (rows, k), torch.int64)],
        {"top_k": k, "norm_topk_prob": int(moe.norm_topk_prob)},
        name=p + "routing",
    )
    total = ""
    for e in range(moe.num_experts):
        q = f"{p}experts.{e}."
        gate = b.linear(x, hf.expert_proj(layer, e, "gate_proj"), inter, q + "gate")
        up = b.linear(x, hf.expert_proj(layer, e, "up_proj"), inter, q + "up")
        down = b.linear(silu_mul(b, gate, up, q), hf.expert_proj(layer, e, "down_proj"), spec.hidden_size, q + "down")
        coef = b.node("ExpertWeight", [weights, ids], [b.act(q + "coef", (rows, 1))], {"expert": e})[0]
        last = e == moe.num_experts - 1
        weighted = b.binary("Mul", down, coef, partial if last and e == 0 else q + "weighted")
        total = weighted if e == 0 else b.binary("Add", total, weighted, partial if last else q + "sum")
    return b.all_reduce(total, out)
