"""Runs the compiler's in-memory graph IR with the runtime's reference ops, for tests only.

Each IR node is bound to the op class the runtime's registry gives its op type (the same classes
qruntime.Plan binds to graph.onnx), so these tests check what the compiler's graph computes before
ONNX export: fused against unfused graphs (the passes rewired the graph and fused the weights
correctly) and unfused graphs against Hugging Face transformers (the builder's math).
"""

from __future__ import annotations

import torch
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS
from qruntime.ops.base import AttentionMetadata, OpEnv, StepContext
from qruntime.ops.registry import reference_ops

from qcompile.compile.jobs import WeightJob
from qcompile.graph.ir import Graph


def materialize(job: WeightJob, sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a weight job writes: each source quantized by its scheme (per-tensor scales are per
    source; per-row and aligned block scales do not see the other parts), concatenated / stacked."""
    if not job.quant.quantized:
        slices = [torch.cat([sources[name] for name in group], 0) for group in job.sources]
        return {job.weight_name: torch.stack(slices) if job.stacked else slices[0]}
    quantized = []
    for group in job.sources:
        parts = [job.quant.quantize(sources[name]) for name in group]
        quantized.append((torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])))
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
    """Runs `graph` step by step with the runtime's ops and a paged KV cache of `num_slots` slots."""

    def __init__(self, graph: Graph, sources: dict[str, torch.Tensor], num_slots: int) -> None:
        self.tensors: dict[str, torch.Tensor] = {n: torch.from_numpy(c) for n, c in graph.constants.items()}
        for job in graph.weights.values():
            self.tensors.update(materialize(job, sources))
        if graph.spec.tie_word_embeddings and "lm_head" not in graph.weights:
            self.tensors.setdefault("model.embed_tokens.weight", sources["model.embed_tokens.weight"])
        spec = graph.spec
        kv = next(node.attrs for node in graph.nodes if "kv_dtype" in node.attrs)  # what the cache ops say
        layout, kv_dtype, block_size = KV_LAYOUTS[kv["layout"]], kv["kv_dtype"], kv["block_size"]
        kv_spec = KVCacheSpec(
            layout, kv_dtype, block_size, spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim
        )
        self.cache = KVCache(kv_spec, -(-num_slots // block_size), graph.model_dtype, torch.device("cpu"))
        env = OpEnv(graph.model_dtype, torch.device("cpu"), kv_spec)
        registry = reference_ops()
        self.nodes = [
            (registry[(n.domain, n.op_type)](n.attrs, env, tuple(self.tensors.get(i) for i in n.inputs)), n)
            for n in graph.nodes
        ]
        self.output = graph.outputs[0]

    def run(self, feeds: dict[str, torch.Tensor]) -> torch.Tensor:
        bs = self.cache.spec.block_size
        tables, lens, qsl = feeds["block_tables"], feeds["context_lens"].tolist(), feeds["query_start_loc"].tolist()
        slots = tuple((tables[b, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs) for b, n in enumerate(lens))
        step = StepContext(self.cache, AttentionMetadata(tuple(qsl), tuple(lens), slots))
        env = {**self.tensors, **feeds, "": None}
        for op, node in self.nodes:
            results = op(step, *(env[name] for name in node.inputs))
            env.update(zip(node.outputs, results if isinstance(results, tuple) else (results,), strict=True))
        return env[self.output]
