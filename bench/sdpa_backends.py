"""Which of torch's fused attention backends is fastest for a causal GQA prefill on this GPU
(qwen3-8b heads: 32 q / 8 kv, head_dim 128): FlashAttention with enable_gqa, cuDNN on K/V expanded
to every q head (expansion included in its time), and the math-free default dispatch.

    python bench/sdpa_backends.py --out bench/results/sdpa_backends.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing
from compile_bench import gpu_report_header
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa


def run(lengths=(2048, 8000), nh: int = 32, kvh: int = 8, d: int = 128) -> list[dict]:
    rows = []
    for t in lengths:
        q = torch.randn(1, nh, t, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, kvh, t, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)

        def flash(q=q, k=k, v=v):
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return sdpa(q, k, v, is_causal=True, enable_gqa=True)

        def cudnn(q=q, k=k, v=v):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return sdpa(q, k.repeat_interleave(nh // kvh, 1), v.repeat_interleave(nh // kvh, 1), is_causal=True)

        def cudnn_gqa(q=q, k=k, v=v):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return sdpa(q, k, v, is_causal=True, enable_gqa=True)

        ref = flash().float()
        row = {"tokens": t}
        for name, fn in (("flash_gqa", flash), ("cudnn_expanded", cudnn), ("cudnn_gqa", cudnn_gqa)):
            try:
                err = float((fn().float() - ref).abs().max())
                row[name] = {"us": round(triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3, 1), "max_err": err}
            except Exception as exc:  # a backend that refuses these inputs: say so and go on
                row[name] = {"error": str(exc).splitlines()[0][:200]}
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = gpu_report_header("sdpa_backends")
    report["versions"]["cudnn"] = torch.backends.cudnn.version()
    report["rows"] = run()
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
