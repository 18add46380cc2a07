"""GPU bench of the fused QK-norm + RoPE + KV-write kernel at qwen3-8b shapes (32 heads, 8 KV heads, d 128).

For each KV layout x kv dtype (bf16, fp8_e4m3) x T in (1, 8, 64, 512): check the kernel (its default
launch configuration for T: `config` is heads per program x num_warps) against the reference op
QKNormRoPEKVWrite (torch on the same GPU, same random inputs and pool contents) and time it. `us` is the GPU time per call from a CUDA graph of calls (triton.testing.do_bench_cudagraph: what
a captured decode step pays), `us_eager` the same with a Python launch per call (do_bench), `ref_us`
the reference op, eager. Errors are relative to the largest |reference| value of the tensor; ok needs
q and k within one bf16 ulp of that scale (fp8 k/v: one e4m3 step), bf16 v exact, and the pools equal
outside the written slots (the reference runs with torch's CUDA math: its rsqrt, pow and division by
the scale are not the IEEE-rounded ones the kernel follows, so a few values differ by an ulp).

    from bench.gpu_kernels.qknorm_rope import run; rows = run("cuda")
"""

from __future__ import annotations

import torch
import triton.testing
from qruntime.kernels.qknorm_rope_kvwrite import _launch_config, qknorm_rope_kvwrite
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS
from qruntime.ops.attention import QKNormRoPEKVWrite
from qruntime.ops.base import OpEnv, StepContext

NH, KVH, D = 32, 8, 128  # qwen3-8b
EPS, THETA, BLOCK_SIZE, NUM_BLOCKS = 1e-6, 1e6, 16, 2048
TOKENS = (1, 8, 64, 512)


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def _case(layout: str, kv_dtype: str, t: int, device: str) -> dict:
    dtype = torch.bfloat16
    spec = KVCacheSpec(KV_LAYOUTS[layout], kv_dtype, BLOCK_SIZE, 1, KVH, D)
    ref_cache = KVCache(spec, NUM_BLOCKS, dtype, torch.device(device))
    for pools in (ref_cache.k, ref_cache.v):  # random contents, so stray writes show
        pools[0] = (torch.randn(pools[0].shape, device=device) * 2).to(pools[0].dtype)
    cache = KVCache(spec, NUM_BLOCKS, dtype, torch.device(device))
    cache.k, cache.v = [ref_cache.k[0].clone()], [ref_cache.v[0].clone()]
    qkv = torch.randn(t, (NH + 2 * KVH) * D, device=device).to(dtype)
    qw = (torch.randn(D, device=device) * 0.2 + 1).to(dtype)
    kw = (torch.randn(D, device=device) * 0.2 + 1).to(dtype)
    positions = torch.randint(0, 32768, (t,), device=device)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device=device)[:t]
    k_scale, v_scale = (0.02, 0.01) if kv_dtype == "fp8_e4m3" else (1.0, 1.0)
    attrs = {"layer": 0, "layout": layout, "block_size": BLOCK_SIZE, "kv_dtype": kv_dtype, "k_scale": k_scale}
    attrs |= {"v_scale": v_scale, "num_heads": NH, "num_kv_heads": KVH, "head_dim": D, "epsilon": EPS, "theta": THETA}
    op = QKNormRoPEKVWrite(attrs, OpEnv(dtype, torch.device(device), spec))

    def ref() -> torch.Tensor:
        return op(StepContext(ref_cache, None), qkv, qw, kw, positions, slots)[0]

    def ours() -> torch.Tensor:
        return qknorm_rope_kvwrite(
            qkv, qw, kw, positions, slots, cache.k[0], cache.v[0],
            num_heads=NH, num_kv_heads=KVH, head_dim=D, eps=EPS, theta=THETA,
            layout=KV_LAYOUTS[layout], block_size=BLOCK_SIZE, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip

    q_ref, q = ref(), ours()
    torch.cuda.synchronize()
    (k_ref, v_ref), (k, v) = ref_cache.gather(0, slots, 1.0, 1.0), cache.gather(0, slots, 1.0, 1.0)
    fp8 = kv_dtype == "fp8_e4m3"
    tol_kv = 2.0**-3 if fp8 else 2.0**-7  # one step at the largest magnitude
    errs = {"q_err": _rel_err(q, q_ref), "k_err": _rel_err(k, k_ref), "v_err": _rel_err(v, v_ref)}
    q_differ = (q != q_ref).float().mean().item()
    # whole pools: written slots within tolerance, everything else unchanged (equal bits)
    same_elsewhere = all(
        (a.view(torch.uint8) != b.view(torch.uint8)).sum().item() <= t * KVH * D * a.element_size()
        for a, b in ((cache.k[0], ref_cache.k[0]), (cache.v[0], ref_cache.v[0]))
    )
    ok = (
        errs["q_err"] <= 2.0**-7
        and errs["k_err"] <= tol_kv
        and (errs["v_err"] <= tol_kv if fp8 else errs["v_err"] == 0)
        and same_elsewhere
    )

    us = triton.testing.do_bench_cudagraph(ours) * 1e3
    us_eager = triton.testing.do_bench(ours) * 1e3
    ref_us = triton.testing.do_bench(ref) * 1e3
    elem = 1 if fp8 else 2
    nbytes = t * (NH + 2 * KVH) * D * 2 + t * NH * D * 2 + 2 * t * KVH * D * elem
    return {
        "kernel": "qknorm_rope_kvwrite",
        "shape": f"nh{NH} kvh{KVH} d{D} {layout} {kv_dtype}",
        "tokens": t,
        "config": "{}x{}".format(*_launch_config(t, NH, KVH, layout == "x-packed", fp8)),
        "us": round(us, 2),
        "us_eager": round(us_eager, 2),
        "ref_us": round(ref_us, 1),
        "GB/s": round(nbytes / us / 1e3, 1),
        "max_err": max(errs.values()),
        **errs,
        "q_frac_differ": q_differ,
        "ok": bool(ok),
    }


def run(device: str = "cuda") -> list[dict]:
    torch.manual_seed(0)
    return [
        _case(layout, kv_dtype, t, device) for layout in KV_LAYOUTS for kv_dtype in ("bf16", "fp8_e4m3") for t in TOKENS
    ]


if __name__ == "__main__":
    for row in run():
        print(row)
