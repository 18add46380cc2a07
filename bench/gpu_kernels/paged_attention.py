"""Paged attention kernels on the GPU at qwen3-8b shapes (32 q heads, 8 KV heads, head_dim 128,
block_size 16): correctness against the reference op and speed.

paged_decode_attention at B in BATCHES x context in CONTEXTS, and paged_prefill_attention for one
8000-token prompt and 4 x 2048, on bf16 nhd and hnd pools (and one fp8 row each). Random K/V in
pools with random (non-contiguous) block tables. The reference op qruntime.ops.attention
.PagedAttention runs on a subsample: for decode the first and last sequence; for prefill the first
128 rows of a prompt (a prompt of 128) and its last 256 rows (a chunk after a cached prefix, which
is exactly what those rows are). ok: every element within 2 bf16 ulps of the reference (+1e-5).
Timed with triton.testing.do_bench (median, L2 flushed before each call); decode replayed from a
CUDA graph as the runtime runs it (eager_us: launched from Python). Decode GB/s counts the KV
bytes read (every cached K and V once); prefill TFLOP/s counts the causal half, 2*2*T^2/2*nh*d per
sequence, and is shown next to torch's SDPA (flash, dense causal GQA) on the same shapes.

    python bench/gpu_kernels/paged_attention.py      (with runtime/ on PYTHONPATH)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from qruntime.kernels.paged_decode_attention import paged_decode_attention
from qruntime.kernels.paged_prefill_attention import paged_prefill_attention
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS
from qruntime.ops.attention import PagedAttention
from qruntime.ops.base import AttentionMetadata, OpEnv, StepContext
from triton.testing import do_bench

NH, KVH, D, BLOCK_SIZE = 32, 8, 128, 16
SCALE = D**-0.5
DTYPE = torch.bfloat16
BATCHES = (1, 16, 64)
CONTEXTS = (512, 2048, 8000)
PREFILLS = ((1, 8000), (4, 2048))  # (sequences, prompt length)
K_SCALE, V_SCALE = 0.02, 0.015  # fp8 pools hold fp8(x / scale)


class Paged:
    """One layer's cache with `batch` sequences of `ctx` tokens of random K/V, random block tables."""

    def __init__(self, layout: str, kv_dtype: str, batch: int, ctx: int, device: str) -> None:
        self.layout, self.kv_dtype, self.ctx = layout, kv_dtype, ctx
        self.spec = KVCacheSpec(KV_LAYOUTS[layout], kv_dtype, BLOCK_SIZE, 1, KVH, D)
        per_seq = -(-ctx // BLOCK_SIZE)
        self.cache = KVCache(self.spec, batch * per_seq, DTYPE, torch.device(device))
        for pool in (self.cache.k[0], self.cache.v[0]):  # any element is a random value: layout-agnostic
            pool.copy_(torch.randn(pool.shape, device=device) * (64 if kv_dtype == "fp8_e4m3" else 1))
        self.block_tables = torch.randperm(batch * per_seq, device=device).view(batch, per_seq).int()
        self.context_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.kwargs = {"layout": layout, "block_size": BLOCK_SIZE, "scale": SCALE, "num_kv_heads": KVH}
        self.kwargs |= {"k_scale": K_SCALE, "v_scale": V_SCALE}

    def pools(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.k[0], self.cache.v[0]

    def kv_bytes(self) -> int:
        return 2 * self.context_lens.numel() * self.ctx * KVH * D * self.cache.k[0].element_size()

    def reference(self, q: torch.Tensor, seqs: list[tuple[int, int, int]]) -> torch.Tensor:
        """The reference op on queries q [T, nh, d] of (sequence, context_len, q_len) rows."""
        starts, slots = [0], []
        for b, ctx, q_len in seqs:
            pos = torch.arange(ctx, device=q.device)
            slots.append(self.block_tables[b].long()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            starts.append(starts[-1] + q_len)
        meta = AttentionMetadata(tuple(starts), tuple(c for _, c, _ in seqs), tuple(slots))
        attrs = {"layer": 0, "layout": self.layout, "block_size": BLOCK_SIZE, "kv_dtype": self.kv_dtype}
        attrs |= {"k_scale": K_SCALE, "v_scale": V_SCALE, "num_heads": NH, "num_kv_heads": KVH, "head_dim": D}
        op = PagedAttention(attrs | {"scale": SCALE}, OpEnv(DTYPE, q.device, self.spec))
        return op(StepContext(self.cache, meta), q, None, None, None, None)


def _errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    err = (got.float() - ref.float()).abs()
    ulp = torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp_min(2.0**-100))) - 7)
    return {
        "max_err": err.max().item(),
        "rel_err": err.max().item() / ref.float().abs().max().item(),
        "ok": bool((err <= 2 * ulp + 1e-5).all()) and bool(torch.isfinite(got).all()),
    }


def _time(f) -> float:
    return do_bench(f, warmup=25, rep=100, return_mode="median") * 1e3  # µs


def _time_graph(f) -> float:
    """f replayed from a CUDA graph, as the runtime runs decode steps: GPU time without the host's
    launch cost (which exceeds the kernels' own time for short contexts)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        f()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        f()
    return _time(graph.replay)


def bench_decode(layout: str, kv_dtype: str, batch: int, ctx: int, device: str) -> dict:
    paged = Paged(layout, kv_dtype, batch, ctx, device)
    q = torch.randn(batch, NH, D, dtype=DTYPE, device=device)
    args = (q, *paged.pools(), paged.block_tables, paged.context_lens)
    out = paged_decode_attention(*args, **paged.kwargs, max_context_len=ctx)
    sample = sorted({0, batch - 1})
    ref = paged.reference(q[sample], [(b, ctx, 1) for b in sample])
    us = _time_graph(lambda: paged_decode_attention(*args, **paged.kwargs, max_context_len=ctx))
    eager_us = _time(lambda: paged_decode_attention(*args, **paged.kwargs, max_context_len=ctx))
    return {
        "kernel": "paged_decode_attention",
        "shape": f"B={batch} ctx={ctx} {layout} {kv_dtype}",
        "tokens": batch,
        "us": round(us, 2),
        "gbps": round(paged.kv_bytes() / (us * 1e-6) / 1e9, 1),
        "eager_us": round(eager_us, 2),
    } | _errors(out[sample], ref)


def bench_prefill(layout: str, kv_dtype: str, batch: int, prompt: int, device: str) -> dict:
    paged = Paged(layout, kv_dtype, batch, prompt, device)
    q = torch.randn(batch * prompt, NH, D, dtype=DTYPE, device=device)
    starts = torch.arange(0, batch * prompt + 1, prompt, dtype=torch.int32, device=device)
    args = (q, *paged.pools(), paged.block_tables, paged.context_lens, starts)
    out = paged_prefill_attention(*args, **paged.kwargs, max_q_len=prompt)
    last, head, tail = batch - 1, 128, 256
    ref = paged.reference(torch.cat([q[:head], q[batch * prompt - tail :]]), [(0, head, head), (last, prompt, tail)])
    got = torch.cat([out[:head], out[batch * prompt - tail :]])
    us = _time(lambda: paged_prefill_attention(*args, **paged.kwargs, max_q_len=prompt))
    flops = batch * 2 * prompt * prompt * NH * D  # causal: 2 matmuls x 2 flops x T^2 / 2
    dense = [torch.randn(batch, h, prompt, D, dtype=DTYPE, device=device) for h in (NH, KVH, KVH)]
    sdpa_us = _time(lambda: F.scaled_dot_product_attention(*dense, is_causal=True, enable_gqa=True))
    return {
        "kernel": "paged_prefill_attention",
        "shape": f"{batch}x{prompt} {layout} {kv_dtype}",
        "tokens": batch * prompt,
        "us": round(us, 2),
        "tflops": round(flops / (us * 1e-6) / 1e12, 1),
        "sdpa_us": round(sdpa_us, 2),
    } | _errors(got, ref)


def run(device: str = "cuda") -> list[dict]:
    """Check and time both kernels at every shape; one dict per (kernel, shape)."""
    rows = []
    for layout in ("nhd", "hnd"):
        for batch in BATCHES:
            for ctx in CONTEXTS:
                rows.append(bench_decode(layout, "bf16", batch, ctx, device))
        for batch, prompt in PREFILLS:
            rows.append(bench_prefill(layout, "bf16", batch, prompt, device))
    rows.append(bench_decode("nhd", "fp8_e4m3", 64, 2048, device))
    rows.append(bench_prefill("nhd", "fp8_e4m3", 4, 2048, device))
    return rows


def main() -> None:
    cols = ("kernel", "shape", "tokens", "us", "gbps", "tflops", "eager_us", "sdpa_us", "ok", "max_err", "rel_err")
    print(" ".join(f"{c:>12}" for c in cols))
    for row in run():
        print(" ".join(f"{str(row.get(c, '')):>12}" for c in cols))


if __name__ == "__main__":
    main()
