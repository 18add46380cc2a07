"""The fast plan with PagedAttention.fold_reduce (the decode kernel merges its partitions in its own
last programs, one launch) gives the two-launch plan's logits bit for bit, on the tiny artifact."""

from __future__ import annotations

import torch
from qruntime.artifact import read_manifest
from qruntime.kernels.paged_decode_attention import decode_num_splits
from qruntime.kv_cache import KVCache
from qruntime.ops.base import StepContext
from qruntime.ops.registry import triton_ops
from qruntime.ops.triton_ops import PagedAttention
from qruntime.plan import Plan
from test_kernel_fast_plan import _step, load_artifact

MAX_CONTEXT = 256  # the engine's bound: 3 partitions per sequence of a 2-decode step (4 "SMs", 2 kv heads)


def test_folded_attention_reduce_gives_the_same_logits(tiny_ckpt, compiled, rng, monkeypatch):
    """A decode-only step (2 sequences) and a mixed one (the same 2 decodes beside a 3-token prompt)
    over a random cache, contexts of 1-40 and 70-120 (a partition past the shorter one's context):
    the plan's logits with fold_reduce equal those without, and the counters are zero afterwards."""
    torch.manual_seed(rng.randrange(1 << 30))
    artifact = compiled(tiny_ckpt, "ptpc-fp8")
    graph, spec, weights, env = load_artifact(artifact)
    assert decode_num_splits(2, spec.num_kv_heads, MAX_CONTEXT, 4) > 1  # the reduce runs at all
    plan = Plan.build(graph, weights, env, triton_ops())
    vocab = int(read_manifest(artifact)["spec"]["vocab_size"])
    cache = KVCache(spec, 14, torch.bfloat16, torch.device("cpu"))
    for pool in (*cache.k, *cache.v):
        pool.copy_(torch.randn(pool.shape).to(pool.dtype))
    blocks = torch.randperm(14).tolist()
    tables = [blocks[:3], blocks[3:11], blocks[11:12]]
    lens = [rng.randint(1, 40), rng.randint(70, 120)]
    print("contexts", lens)
    token = lambda: rng.randrange(vocab)  # noqa: E731
    decodes = [([token()], lens[0] - 1), ([token()], lens[1] - 1)]
    steps = [
        _step(decodes, tables[:2], MAX_CONTEXT),
        _step([*decodes, ([token() for _ in range(3)], 0)], tables, MAX_CONTEXT),
    ]
    ops = [node.op for node in plan.nodes if isinstance(node.op, PagedAttention)]
    assert len(ops) == spec.num_layers
    for feeds, meta in steps:
        logits = plan.run(StepContext(cache, meta), feeds)  # fold_reduce off: two launches
        assert all(op.counters is None for op in ops)
        monkeypatch.setattr(PagedAttention, "fold_reduce", True)
        folded = plan.run(StepContext(cache, meta), feeds)
        monkeypatch.setattr(PagedAttention, "fold_reduce", False)
        assert torch.equal(logits.view(torch.int16), folded.view(torch.int16))
        assert all(op.counters is not None and not op.counters.any() for op in ops)
        for op in ops:
            op.counters = None
