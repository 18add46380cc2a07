"""The fast path's op table bound to a whole compiled graph: under the Triton interpreter on CPU, a
prefill step and a decode step of the tiny dense model give the reference plan's logits."""

from __future__ import annotations

import onnx
import pytest
import torch
from qruntime.artifact import read_manifest
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.ops.base import AttentionMetadata, OpEnv, StepContext
from qruntime.ops.registry import reference_ops, triton_ops
from qruntime.plan import Plan
from qruntime.weights import load_initializers

BLOCK = 16


def _step(chunks: list[tuple[list[int], int]], tables: list[list[int]], max_context: int):
    """Feeds and metadata for sequences given as (new tokens, tokens already cached)."""
    ids, positions, slots, starts, lens = [], [], [], [0], []
    for (tokens, start), table in zip(chunks, tables, strict=True):
        for i, token in enumerate(tokens):
            pos = start + i
            ids.append(token)
            positions.append(pos)
            slots.append(table[pos // BLOCK] * BLOCK + pos % BLOCK)
        starts.append(starts[-1] + len(tokens))
        lens.append(start + len(tokens))
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    cache_slots = tuple(
        torch.tensor([tables[b][p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]) for b, n in enumerate(lens)
    )
    feeds = {
        "input_ids": torch.tensor(ids),
        "positions": torch.tensor(positions),
        "slot_mapping": torch.tensor(slots),
        "block_tables": block_tables,
        "context_lens": torch.tensor(lens, dtype=torch.int32),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
        "logits_indices": torch.tensor(starts[1:]) - 1,
    }
    meta = AttentionMetadata(tuple(starts), tuple(lens), cache_slots, max(len(t) for t, _ in chunks), max_context)
    return feeds, meta


@pytest.mark.parametrize("layout", ["nhd", "x-packed"])
def test_fast_plan_matches_the_reference_plan(tiny_ckpt, compiled, layout):
    artifact = compiled(tiny_ckpt, "ptpc-fp8", f"kv_cache.layout={layout}")
    graph = onnx.load(str(artifact / "graph.onnx"), load_external_data=False).graph
    spec = KVCacheSpec.from_manifest(read_manifest(artifact)["kv_cache"])
    weights = load_initializers(artifact, graph, torch.device("cpu"), torch.bfloat16)
    env = OpEnv(torch.bfloat16, torch.device("cpu"), spec)
    plans = {
        name: Plan.build(graph, weights, env, table)
        for name, table in (("ref", reference_ops()), ("fast", triton_ops()))
    }
    assert type(plans["fast"].nodes[1].op).__module__ == "qruntime.ops.triton_ops"
    caches = {name: KVCache(spec, 8, torch.bfloat16, torch.device("cpu")) for name in plans}
    vocab = int(read_manifest(artifact)["spec"]["vocab_size"])
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in (21, 5)]
    tables = [[3, 6], [1]]
    steps = [
        _step([(prompts[0], 0), (prompts[1], 0)], tables, 64),  # prefill of both
        _step([([7], 21), ([9], 5)], tables, 64),  # a decode step
    ]
    for feeds, meta in steps:
        logits = {name: plan.run(StepContext(caches[name], meta), feeds).float() for name, plan in plans.items()}
        # fp8 activation rounding may differ on interpreter ties: a handful of ulps, not a different model
        noise = (logits["fast"] - logits["ref"]).pow(2).mean() / logits["ref"].pow(2).mean()
        assert float(noise) < 1e-3
