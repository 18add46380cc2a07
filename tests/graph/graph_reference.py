"""A small torch interpreter of the compiler's graph IR, written from docs/OPS.md, for tests only.

Fused ops are evaluated by their unfused definitions, so running a fused and an unfused graph of the
same model and comparing checks that the passes rewired the graph (and fused the weights) correctly;
running an unfused graph against Hugging Face transformers checks the builder's math.
"""

from __future__ import annotations

import torch

from qcompile.graph.ir import Graph
from qcompile.jobs import WeightJob

FP8_MAX = 448.0


def materialize(job: WeightJob, sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a weight job writes: sources concatenated / stacked, then quantized by its scheme."""
    slices = [torch.cat([sources[name] for name in group], 0) for group in job.sources]
    if not job.quant.quantized:
        return {job.weight_name: torch.stack(slices) if job.stacked else slices[0]}
    quantized = [job.quant.quantize(s) for s in slices]
    weight = torch.stack([q for q, _ in quantized]) if job.stacked else quantized[0][0]
    scale = torch.stack([s for _, s in quantized]) if job.stacked else quantized[0][1]
    assert job.scale_name is not None
    return {job.weight_name: weight, job.scale_name: scale}


def make_step(new_tokens: list[list[int]], starts: list[int], block_size: int, max_blocks: int) -> dict:
    """Graph inputs for one step: sequence b already has starts[b] cached tokens and adds new_tokens[b];
    sequence b owns blocks b*max_blocks ... (b+1)*max_blocks-1 in the cache."""
    ids, positions, slots, qsl = [], [], [], [0]
    tables = torch.tensor(
        [[b * max_blocks + j for j in range(max_blocks)] for b in range(len(new_tokens))], dtype=torch.int32
    )
    for b, (tokens, start) in enumerate(zip(new_tokens, starts, strict=True)):
        for i, token in enumerate(tokens):
            pos = start + i
            ids.append(token)
            positions.append(pos)
            slots.append(int(tables[b, pos // block_size]) * block_size + pos % block_size)
        qsl.append(qsl[-1] + len(tokens))
    return {
        "input_ids": torch.tensor(ids, dtype=torch.int64),
        "positions": torch.tensor(positions, dtype=torch.int64),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "block_tables": tables,
        "context_lens": torch.tensor([s + len(t) for s, t in zip(starts, new_tokens, strict=True)], dtype=torch.int32),
        "query_start_loc": torch.tensor(qsl, dtype=torch.int32),
        "logits_indices": torch.tensor(qsl[1:], dtype=torch.int64) - 1,
    }


class Reference:
    """Runs `graph` step by step, keeping its own KV cache (one [slots, kv_heads, head_dim] pool per layer)."""

    def __init__(self, graph: Graph, sources: dict[str, torch.Tensor], num_slots: int) -> None:
        self.graph = graph
        self.dtype = graph.model_dtype
        self.num_slots = num_slots
        self.tensors: dict[str, torch.Tensor] = {n: torch.from_numpy(c) for n, c in graph.constants.items()}
        for job in graph.weights.values():
            self.tensors.update(materialize(job, sources))
        if graph.spec.tie_word_embeddings and "lm_head" not in graph.weights:
            self.tensors.setdefault("model.embed_tokens.weight", sources["model.embed_tokens.weight"])
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def run(self, feeds: dict[str, torch.Tensor]) -> torch.Tensor:
        env = {**self.tensors, **feeds, "": None}
        for node in self.graph.nodes:
            results = getattr(self, f"op_{node.op_type}")(dict(node.attrs), *(env[name] for name in node.inputs))
            results = results if isinstance(results, tuple) else (results,)
            env.update(zip(node.outputs, results, strict=True))
        return env[self.graph.outputs[0]]

    # --- standard ops ------------------------------------------------------------------------------
    def op_Gather(self, a, data, indices):
        return data[indices.long()]

    def op_RMSNormalization(self, a, x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + a["epsilon"])).to(self.dtype) * w

    def op_Add(self, a, x, y):
        return x + y

    def op_Mul(self, a, x, y):
        return x * y

    def op_Sigmoid(self, a, x):
        return torch.sigmoid(x)

    def op_Split(self, a, x, sizes):
        return tuple(torch.split(x, sizes.tolist(), dim=a["axis"]))

    def op_Reshape(self, a, x, shape):
        return x.reshape(shape.tolist())

    def op_Gemm(self, a, x, w):
        return x @ w.T

    # --- qcompile ops ------------------------------------------------------------------------------
    def op_DynamicQuant(self, a, x):
        x32, group = x.float(), a["group_size"]
        rows, cols = x32.shape
        width = cols if group == 0 else group
        groups = -(-cols // width)
        padded = torch.nn.functional.pad(x32, (0, groups * width - cols)).reshape(rows, groups, width)
        scale = torch.clamp(padded.abs().amax(-1) / FP8_MAX, min=1e-12)  # [T, G]
        q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).reshape(rows, -1)[:, :cols]
        return q.to(torch.float8_e4m3fn), scale

    def op_PTPCLinear(self, a, xq, xs, w, ws):
        return ((xq.float() @ w.float().T) * xs * ws.float().T).to(self.dtype)

    def op_BlockFP8Linear(self, a, xq, xs, w, ws):
        bn, bk = a["block_n"], a["block_k"]
        n, k = w.shape
        y = torch.zeros(xq.shape[0], n)
        for kb in range(-(-k // bk)):
            part = xq[:, kb * bk : (kb + 1) * bk].float() @ w[:, kb * bk : (kb + 1) * bk].float().T
            y += part * xs[:, kb : kb + 1] * ws[:, kb].float().repeat_interleave(bn)[:n][None]
        return y.to(self.dtype)

    def op_RoPE(self, a, x, positions):
        d = a["head_dim"]
        inv_freq = 1.0 / (a["theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        freqs = positions.float()[:, None] * inv_freq[None]
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        x32 = x.float()
        rotated = torch.cat([-x32[..., d // 2 :], x32[..., : d // 2]], -1)
        return (x32 * cos + rotated * sin).to(self.dtype)

    def op_KVCacheWrite(self, a, k, v, slots):
        if a["layer"] not in self.cache:
            shape = (self.num_slots, *k.shape[1:])
            self.cache[a["layer"]] = (torch.zeros(shape, dtype=k.dtype), torch.zeros(shape, dtype=v.dtype))
        cache_k, cache_v = self.cache[a["layer"]]
        cache_k[slots] = k
        cache_v[slots] = v
        return torch.zeros(0, dtype=torch.uint8)

    def op_PagedAttention(self, a, q, ready, tables, context_lens, qsl):
        cache_k, cache_v = self.cache[a["layer"]]
        bs, group = a["block_size"], a["num_heads"] // a["num_kv_heads"]
        out = []
        for b in range(len(context_lens)):
            qb = q[int(qsl[b]) : int(qsl[b + 1])].float()  # [q_len, nh, d]
            ctx, q_len = int(context_lens[b]), qb.shape[0]
            pos = torch.arange(ctx)
            slots = tables[b, pos // bs].long() * bs + pos % bs
            kb = cache_k[slots].float().repeat_interleave(group, 1)  # [ctx, nh, d]
            vb = cache_v[slots].float().repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", qb, kb) * a["scale"]
            allowed = pos[None, :] <= (ctx - q_len + torch.arange(q_len))[:, None]
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            out.append(torch.einsum("hqk,khd->qhd", probs, vb).reshape(q_len, -1))
        return torch.cat(out).to(self.dtype)

    def op_MoERouting(self, a, logits):
        probs = logits.float().softmax(-1)
        weights, ids = probs.topk(a["top_k"], -1)
        if a["norm_topk_prob"]:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(self.dtype), ids

    def op_ExpertWeight(self, a, weights, ids):
        return (weights * (ids == a["expert"])).sum(-1, keepdim=True)

    # --- fused ops, by their unfused forms ---------------------------------------------------------
    def op_AddRMSNorm(self, a, x, residual, w):
        out = x if residual is None else x + residual
        return self.op_RMSNormalization(a, out, w), out

    def op_AddRMSNormQuant(self, a, x, residual, w):
        y, out = self.op_AddRMSNorm(a, x, residual, w)
        return (*self.op_DynamicQuant(a, y), out)

    def op_SiluMul(self, a, gate_up):
        gate, up = gate_up.chunk(2, -1)
        return gate * torch.sigmoid(gate) * up

    def op_SiluMulQuant(self, a, gate_up):
        return self.op_DynamicQuant(a, self.op_SiluMul(a, gate_up))

    def op_QKNormRoPEKVWrite(self, a, qkv, q_norm_w, k_norm_w, positions, slots):
        nh, kvh, d = a["num_heads"], a["num_kv_heads"], a["head_dim"]
        q, k, v = torch.split(qkv, [nh * d, kvh * d, kvh * d], -1)
        q = self.op_RoPE(a, self.op_RMSNormalization(a, q.reshape(-1, nh, d), q_norm_w), positions)
        k = self.op_RoPE(a, self.op_RMSNormalization(a, k.reshape(-1, kvh, d), k_norm_w), positions)
        return q, self.op_KVCacheWrite(a, k, v.reshape(-1, kvh, d), slots)

    def op_MoE(self, a, x, router_w, w13, w13_scale, w2, w2_scale):
        weights, ids = self.op_MoERouting(a, x @ router_w.T)
        total = None
        for e in range(a["num_experts"]):
            act = self.op_SiluMul(a, self._linear(a, x, w13[e], None if w13_scale is None else w13_scale[e]))
            down = self._linear(a, act, w2[e], None if w2_scale is None else w2_scale[e])
            weighted = down * self.op_ExpertWeight({"expert": e}, weights, ids)
            total = weighted if total is None else total + weighted
        return total

    def _linear(self, a, x, w, ws):
        if a["linear"] == "Gemm":
            return x @ w.T
        xq, xs = self.op_DynamicQuant(a, x)
        return getattr(self, f"op_{a['linear']}")(a, xq, xs, w, ws)
