"""RoPE, the KV-cache write, paged attention, and their fused form."""

from __future__ import annotations

import torch

from qruntime.ops import functional as fn
from qruntime.ops.base import KVOp, Op, OpBindError


def _mrope_section(op: Op) -> tuple[int, int, int] | None:
    """The node's optional mrope_section attribute, checked against head_dim (OpBindError naming it)."""
    section = op.a["mrope_section"]
    if section is None:
        return None
    try:
        return fn.check_mrope_section(section, op.a["head_dim"])
    except ValueError as exc:
        raise OpBindError(f"attribute {exc}") from exc


class RoPE(Op):
    """Rotate-half RoPE; with mrope_section (Qwen3-VL) positions are [3, T] (fn.rope)."""

    attrs = ("theta", "head_dim")
    optional_attrs = {"mrope_section": None}

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        self.mrope_section = _mrope_section(self)

    def __call__(self, step, x, positions):
        return fn.rope(x, positions, self.a["theta"], self.a["head_dim"], self.mrope_section)


class KVCacheWrite(KVOp):
    """Store k, v [T, kvh, d] at their slots in this layer's cache; output the ordering token kv_ready."""

    def __call__(self, step, k, v, slots):
        a = self.a
        step.kv_cache.write(a["layer"], k, v, slots, a["k_scale"], a["v_scale"])
        return k.new_empty(0, dtype=torch.uint8)


class PagedAttention(KVOp):
    """Causal GQA attention of each sequence's queries over its cached keys (prefill, decode or mixed).

    Query i of a sequence with q_len queries sits at position context_len - q_len + i and sees the
    cache positions <= it. Scores, softmax and the weighted sum are in fp32."""

    attrs = (*KVOp.attrs, "num_heads", "num_kv_heads", "head_dim", "scale")
    capturable = False  # loops over the step's sequences on the host
    splits_graph = True  # per-sequence work: runs eagerly between the pieces of a piecewise CUDA graph

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        if self.a["num_heads"] % self.a["num_kv_heads"]:
            raise OpBindError(f"num_heads {self.a['num_heads']} is not a multiple of num_kv_heads")
        if self.a["num_kv_heads"] != env.kv_spec.num_kv_heads or self.a["head_dim"] != env.kv_spec.head_dim:
            raise OpBindError("num_kv_heads/head_dim differ from the manifest's kv_cache")

    def __call__(self, step, q, ready, block_tables, context_lens, query_start_loc):
        a, meta = self.a, step.attn
        group = a["num_heads"] // a["num_kv_heads"]
        out = torch.empty(q.shape[0], a["num_heads"] * a["head_dim"], dtype=q.dtype, device=q.device)
        for b, ctx in enumerate(meta.context_lens):
            start, end = meta.query_start[b], meta.query_start[b + 1]
            k, v = step.kv_cache.gather(a["layer"], meta.cache_slots[b], a["k_scale"], a["v_scale"])  # [ctx, kvh, d]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [ctx, nh, d]
            qb = q[start:end].float()  # [q_len, nh, d]
            scores = torch.einsum("qhd,khd->hqk", qb, k) * a["scale"]
            q_pos = torch.arange(ctx - (end - start), ctx, device=q.device)
            allowed = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).reshape(end - start, -1).to(q.dtype)
        return out


class QKNormRoPEKVWrite(KVOp):
    """Split qkv, per-head RMSNorm of q and k, RoPE on both, write k and v to the cache; return q."""

    attrs = (*KVOp.attrs, "num_heads", "num_kv_heads", "head_dim", "epsilon", "theta")
    optional_attrs = {"mrope_section": None}

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        self.mrope_section = _mrope_section(self)

    def __call__(self, step, qkv, q_norm_w, k_norm_w, positions, slots):
        a, section = self.a, self.mrope_section
        nh, kvh, d = a["num_heads"], a["num_kv_heads"], a["head_dim"]
        q, k, v = torch.split(qkv, [nh * d, kvh * d, kvh * d], -1)
        q = fn.rope(fn.rms_norm(q.reshape(-1, nh, d), q_norm_w, a["epsilon"]), positions, a["theta"], d, section)
        k = fn.rope(fn.rms_norm(k.reshape(-1, kvh, d), k_norm_w, a["epsilon"]), positions, a["theta"], d, section)
        step.kv_cache.write(a["layer"], k, v.reshape(-1, kvh, d), slots, a["k_scale"], a["v_scale"])
        return q, qkv.new_empty(0, dtype=torch.uint8)
