"""The fast path's attention op alone, on qwen3-8b shapes (32 q / 8 kv heads, head_dim 128, bf16 KV
in nhd blocks of 16, 36 layers), for mixed steps (decodes beside prompts) and their parts alone:
the op as it was (every step that is not decode-only in the varlen prefill kernel) against the op
now (decode rows in the decode kernel, the rest in the prefill kernel), summed over the 36 layers.

    PYTHONPATH=runtime:bench python bench/mixed_attention.py --out bench/results/mixed_attention_h100.json

Per shape and path: `gpu_ms`, a CUDA graph of the 36 calls replayed (GPU time alone); `eager_ms`, the
36 calls as the engine runs them (host dispatch included where it is the longer); `host_ms`, the
time to issue them. The new output is checked against the old one and both against the reference
op (torch, fp32 softmax) on layer 0: max abs difference, and the share of elements within 2 bf16 ulps
+ 4e-5 of the reference (the kernel tests' tolerance).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton
import triton.testing
from compile_bench import gpu_report_header
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS
from qruntime.ops.attention import PagedAttention as ReferenceAttention
from qruntime.ops.base import AttentionMetadata, OpEnv, StepContext
from qruntime.ops.triton_ops import PagedAttention

NH, KVH, D, BLOCK, LAYERS = 32, 8, 128, 16, 36
DEVICE = torch.device("cuda")
MAX_CONTEXT = 40960  # qwen3-8b's max_position_embeddings: the engine's max_context_len
# (decodes, their context, prompts, prompt tokens, cached prefix of each prompt)
SHAPES = [
    (64, 192, 16, 128, 0),
    (112, 192, 16, 128, 0),
    (64, 192, 4, 128, 0),
    (0, 0, 16, 128, 0),
    (64, 192, 0, 0, 0),
    (128, 192, 0, 0, 0),
    (16, 4096, 1, 512, 2048),  # long decodes beside a prefill chunk after a cached prefix
]


def old_call(op: PagedAttention, step, q, ready, block_tables, context_lens, query_start_loc):
    """PagedAttention.__call__ before decode rows went to the decode kernel (at c43c478), less its
    branch for steps of fresh prompts of 512 tokens or more (torch's SDPA), which no shape here takes."""
    a, cache, meta = op.a, step.kv_cache, step.attn
    common = dict(
        layout=cache.spec.layout,
        block_size=a["block_size"],
        scale=a["scale"],
        k_scale=a["k_scale"],
        v_scale=a["v_scale"],
        num_kv_heads=a["num_kv_heads"],
    )
    pools = (cache.k[a["layer"]], cache.v[a["layer"]])
    if meta.decode_only:
        return op.decode(q, *pools, block_tables, context_lens, max_context_len=meta.max_context_len, **common)
    return op.prefill(q, *pools, block_tables, context_lens, query_start_loc, max_q_len=meta.max_q_len, **common)


def build_step(cache: KVCache, decodes: int, ctx: int, prompts: int, prompt_len: int, prefix: int, g):
    """Sequences interleaved (a prompt every few decodes, as the scheduler's admission order gives them),
    random non-contiguous block tables, random q."""
    seqs = [(ctx, 1)] * decodes
    for i in range(prompts):
        seqs.insert(i * (decodes // max(prompts, 1) + 1), (prefix + prompt_len, prompt_len))
    per_seq = [triton.cdiv(c, BLOCK) for c, _ in seqs]
    free = torch.randperm(cache.num_blocks, generator=g)[: sum(per_seq)].tolist()
    tables = torch.zeros(len(seqs), max(per_seq), dtype=torch.int32)
    starts, slots = [0], []
    for b, (c, q_len) in enumerate(seqs):
        tables[b, : per_seq[b]] = torch.tensor(free[: per_seq[b]], dtype=torch.int32)
        free = free[per_seq[b] :]
        pos = torch.arange(c)
        slots.append((tables[b].long()[pos // BLOCK] * BLOCK + pos % BLOCK).to(DEVICE))
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        tuple(starts), tuple(c for c, _ in seqs), tuple(slots), max(q for _, q in seqs), MAX_CONTEXT
    )
    q = torch.randn(starts[-1], NH, D, generator=g).to(DEVICE, torch.bfloat16)
    feeds = (
        tables.to(DEVICE),
        torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=DEVICE),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
    )
    return StepContext(cache, meta), q, feeds


def timings(fn) -> dict[str, float]:
    fn()  # compile
    torch.cuda.synchronize()
    host = []
    for _ in range(20):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        host.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    eager = triton.testing.do_bench(fn, warmup=25, rep=200)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    gpu = triton.testing.do_bench(graph.replay, warmup=25, rep=200)
    return {"gpu_ms": round(gpu, 3), "eager_ms": round(eager, 3), "host_ms": round(statistics.median(host) * 1e3, 3)}


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    err = (got.float() - ref.float()).abs()
    exponent = torch.floor(torch.log2(ref.float().abs().clamp_min(2.0**-100)))
    tol = 2 * torch.exp2(exponent - 7) + 4e-5
    return {"max_abs": float(err.max()), "within_tol": float((err <= tol).float().mean())}


def run(shapes) -> list[dict]:
    spec = KVCacheSpec(KV_LAYOUTS["nhd"], "bf16", BLOCK, LAYERS, KVH, D)
    blocks = max(d * triton.cdiv(c, BLOCK) + p * triton.cdiv(x + n, BLOCK) for d, c, p, n, x in shapes) + 64
    cache = KVCache(spec, blocks, torch.bfloat16, DEVICE)
    for pool in (*cache.k, *cache.v):
        pool.normal_()
    env = OpEnv(torch.bfloat16, DEVICE, spec)
    attrs = {"layout": "nhd", "block_size": BLOCK, "kv_dtype": "bf16", "k_scale": 1.0, "v_scale": 1.0}
    attrs |= {"num_heads": NH, "num_kv_heads": KVH, "head_dim": D, "scale": D**-0.5}
    ops = [PagedAttention(attrs | {"layer": layer}, env) for layer in range(LAYERS)]
    reference = ReferenceAttention(attrs | {"layer": 0}, env)
    g = torch.Generator().manual_seed(0)
    rows = []
    for decodes, ctx, prompts, prompt_len, prefix in shapes:
        step, q, feeds = build_step(cache, decodes, ctx, prompts, prompt_len, prefix, g)
        row = {"decodes": decodes, "decode_context": ctx, "prompts": prompts, "prompt_tokens": prompt_len}
        row |= {"prompt_prefix": prefix, "tokens": q.shape[0]}
        for name, call in (("old", old_call), ("new", PagedAttention.__call__)):

            def step_fn(call=call, step=step, q=q, feeds=feeds):
                for op in ops:
                    call(op, step, q, None, *feeds)

            row[name] = timings(step_fn)
        new, old = (call(ops[0], step, q, None, *feeds) for call in (PagedAttention.__call__, old_call))
        ref = reference(step, q, None, *feeds)
        row["new_vs_old"] = compare(new, old)
        row["new_vs_reference"], row["old_vs_reference"] = compare(new, ref), compare(old, ref)
        row["speedup_gpu"] = round(row["old"]["gpu_ms"] / row["new"]["gpu_ms"], 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = gpu_report_header("mixed_attention")
    report["shapes"] = {"num_heads": NH, "num_kv_heads": KVH, "head_dim": D, "block_size": BLOCK, "layers": LAYERS}
    report["rows"] = run(SHAPES)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
