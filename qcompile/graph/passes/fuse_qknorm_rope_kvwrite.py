"""fuse_qknorm_rope_kvwrite: Split/Reshape/RMSNorm/RoPE/KVCacheWrite over a fused qkv -> QKNormRoPEKVWrite."""

from __future__ import annotations

from qcompile.graph.ir import Graph, Node
from qcompile.graph.ops import DOMAIN
from qcompile.graph.passes.base import GraphPass
from qcompile.graph.rewrite import Rewrite

NAME = "fuse_qknorm_rope_kvwrite"
KV_ATTRS = ("layer", "layout", "block_size", "kv_dtype", "k_scale", "v_scale")
ROPE_OPTIONAL = ("mrope_section",)  # Qwen3-VL's M-RoPE (positions [3, T]), carried over as it is


def fuse_qknorm_rope_kvwrite(graph: Graph) -> Graph:
    """Replace q, k, v = Split(qkv); per-head Reshape; q/k RMSNormalization; q/k RoPE; KVCacheWrite(k, v)
    by one QKNormRoPEKVWrite(qkv, q_norm_w, k_norm_w, positions, slot_mapping) -> (q, kv_ready); the
    RoPE's `mrope_section` (a Qwen3-VL model's) goes onto the fused op."""
    rw = Rewrite(graph)
    for index, split in enumerate(graph.nodes):
        match = _match(rw, index, split)
        if match is None:
            continue
        nodes = {key: rw.node(i) for key, i in match.items()}
        q_norm, k_norm, q_rope, write = nodes["q_norm"], nodes["k_norm"], nodes["q_rope"], nodes["write"]
        q_heads = rw.constant(nodes["q_reshape"].inputs[1])
        kv_heads = rw.constant(nodes["k_reshape"].inputs[1])
        assert q_heads is not None and kv_heads is not None
        attrs = {
            **{key: write.attrs[key] for key in KV_ATTRS},
            "num_heads": int(q_heads[1]),
            "num_kv_heads": int(kv_heads[1]),
            "head_dim": int(q_heads[2]),
            "epsilon": q_norm.attrs["epsilon"],
            "theta": q_rope.attrs["theta"],
            **{key: q_rope.attrs[key] for key in ROPE_OPTIONAL if key in q_rope.attrs},
        }
        inputs = (split.inputs[0], q_norm.inputs[1], k_norm.inputs[1], q_rope.inputs[1], write.inputs[2])
        name = f"layers.{write.attrs['layer']}.qk_norm_rope_kv_write"
        rw.remove(match.values())
        rw.insert(index, Node("QKNormRoPEKVWrite", DOMAIN, inputs, (q_rope.outputs[0], write.outputs[0]), attrs, name))
    return rw.apply() if rw.changed else graph


def _match(rw: Rewrite, index: int, split: Node) -> dict[str, int] | None:
    """The nodes of the unfused form starting at a three-way Split, by role, else None."""
    if not split.is_op("Split") or len(split.outputs) != 3 or split.attrs.get("axis") != -1:
        return None
    found = {"split": index}
    for name, value in zip("qkv", split.outputs, strict=True):
        reshape = rw.sole_user(value, "Reshape")
        if reshape is None or rw.constant(rw.node(reshape).inputs[1]) is None:
            return None
        found[f"{name}_reshape"] = reshape
        if name == "v":
            break
        norm = rw.sole_user(rw.node(reshape).outputs[0], "RMSNormalization")
        rope = None if norm is None else rw.sole_user(rw.node(norm).outputs[0], "RoPE")
        if norm is None or rope is None:
            return None
        found[f"{name}_norm"], found[f"{name}_rope"] = norm, rope
    write = rw.sole_user(rw.node(found["k_rope"]).outputs[0], "KVCacheWrite")
    v_heads = rw.node(found["v_reshape"]).outputs[0]
    if write is None or rw.node(write).inputs[:2] != (rw.node(found["k_rope"]).outputs[0], v_heads):
        return None
    if rw.users(v_heads) != [write]:
        return None
    q_norm, k_norm = rw.node(found["q_norm"]), rw.node(found["k_norm"])
    q_rope, k_rope = rw.node(found["q_rope"]), rw.node(found["k_rope"])
    if q_norm.attrs != k_norm.attrs or q_rope.attrs != k_rope.attrs or q_rope.inputs[1] != k_rope.inputs[1]:
        return None
    found["write"] = write
    return found


PASS = GraphPass(NAME, fuse_qknorm_rope_kvwrite, requires=("fuse_qkv_proj",))
