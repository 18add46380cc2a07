"""Issue-22 benchmark: the custom one-shot and two-shot all-reduces over CUDA IPC peer memory against
NCCL, on the GPUs of one host, at decode-sized messages and beyond.

For each tp in --tp (tp processes, rank r on cuda:r, NCCL_NVLS_ENABLE=0) and each message size:
  - correctness: the custom sum equals NCCL's at tp=2 bit for bit (one bf16 addition), is within
    bf16 rounding of it at more ranks, and is the same on every rank;
  - time per all-reduce: --calls back-to-back calls captured in one CUDA graph, replayed --replays
    times, so launch overhead is out of both (a decode step replays its graph the same way);
  - the LL kernel (data and flag pushed in one word: kernels/ll_allreduce.py) up to LL_MAX_KB, its
    bits checked equal to the one-shot's;
  - the fused kernel (all-reduce + residual add + RMSNorm + per-token FP8 quant, [T, H] bf16) against
    NCCL's all-reduce, and the custom one, each followed by the add_rmsnorm_quant kernel, at the
    token counts of decode (its bits checked against the custom all-reduce + kernel); and the fused
    LL kernel where the message is within LL_MAX_KB (its bits checked the same way).

    python bench/allreduce_bench.py --tp 2,4 --out bench/results/allreduce_bench_h200x4.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))

from qcompile.tune.allreduce import graph_us

SIZES_KB = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
FUSED_TOKENS = (1, 4, 16, 64)
LL_MAX_KB = 128  # the LL kernel is timed up to this size


def _rank(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=device
    )
    from qruntime.comm.all_reduce import AllReducePolicy, AllReducer
    from qruntime.kernels.add_rmsnorm_quant import add_rmsnorm_quant

    group = dist.group.WORLD
    # each reducer takes its kernel alone (the defaults would send small messages to LL)
    reducer = AllReducer.create(group, device, AllReducePolicy(max(SIZES_KB) << 10, max_ll_bytes=0))
    two_shot = AllReducer.create(
        group, device, AllReducePolicy(0, max_two_shot_bytes=max(SIZES_KB) << 10, max_ll_bytes=0)
    )
    ll = AllReducer.create(group, device, AllReducePolicy(0, max_ll_bytes=LL_MAX_KB << 10))
    rows = {"tp": world, "all_reduce": reducer.describe(), "sizes": [], "fused": []}
    gen = torch.Generator(device).manual_seed(1000 + rank)
    warm = torch.randn(1 << 20, device=device, generator=gen)
    for _ in range(2000):  # about a second of collectives first: clocks up, NCCL's channels set up
        dist.all_reduce(warm, group=group)
    torch.cuda.synchronize()
    for kb in SIZES_KB:
        n = (kb << 10) // 2
        x = torch.randn(n, device=device, generator=gen).to(torch.bfloat16)
        want = x.clone()
        dist.all_reduce(want, group=group)
        got = reducer.all_reduce(x.clone())
        every = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(every, got, group=group)
        row = {
            "kb": kb,
            "bit_equal_nccl": bool(torch.equal(got, want)),
            "max_abs_diff_nccl": float((got.float() - want.float()).abs().max()),
            "same_on_every_rank": all(torch.equal(e, got) for e in every),
        }
        buf = x.clone()
        row["nccl_us"] = graph_us(lambda buf=buf: dist.all_reduce(buf, group=group), args.calls, args.replays)
        row["one_shot_us"] = graph_us(lambda buf=buf: reducer.all_reduce(buf), args.calls, args.replays)
        row["one_shot_over_nccl"] = row["one_shot_us"] / row["nccl_us"]
        row["two_shot_bit_equal_one_shot"] = bool(torch.equal(two_shot.all_reduce(x.clone()), got))
        row["two_shot_us"] = graph_us(lambda buf=buf: two_shot.all_reduce(buf), args.calls, args.replays)
        if kb <= LL_MAX_KB:
            assert ll.kernel(x) == "ll"
            row["ll_bit_equal_one_shot"] = bool(torch.equal(ll.all_reduce(x.clone()), got))
            row["ll_us"] = graph_us(lambda buf=buf: ll.all_reduce(buf), args.calls, args.replays)
            row["ll_over_nccl"] = row["ll_us"] / row["nccl_us"]
        rows["sizes"].append(row)
    for hidden in args.hidden:
        w = (torch.rand(hidden, device=device, generator=gen) + 0.5).to(torch.bfloat16)
        for tokens in FUSED_TOKENS:
            x = torch.randn(tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
            residual = torch.randn(tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
            # the custom all-reduce then the kernel: the same sum, so the same bits at any tp
            want = add_rmsnorm_quant(reducer.all_reduce(x.clone()), residual, w, 1e-6)
            got = reducer.all_reduce_add_rmsnorm(x.clone(), residual, w, 1e-6, True)
            got_ll = ll.all_reduce_add_rmsnorm(x.clone(), residual, w, 1e-6, True) if ll.kernel(x) == "ll" else None
            row = {"tokens": tokens, "hidden": hidden, "fused_taken": got is not None}
            if got is not None:
                row["equal_unfused"] = [
                    bool(torch.equal(g.view(torch.uint8), v.view(torch.uint8))) for g, v in zip(got, want, strict=True)
                ]

                def unfused(x=x, residual=residual, w=w):
                    dist.all_reduce(x, group=group)
                    add_rmsnorm_quant(x, residual, w, 1e-6)

                def custom_unfused(x=x, residual=residual, w=w):
                    add_rmsnorm_quant(reducer.all_reduce(x), residual, w, 1e-6)

                row["nccl_then_kernel_us"] = graph_us(unfused, args.calls, args.replays)
                row["custom_then_kernel_us"] = graph_us(custom_unfused, args.calls, args.replays)
                row["fused_us"] = graph_us(
                    lambda x=x, residual=residual, w=w: reducer.all_reduce_add_rmsnorm(x, residual, w, 1e-6, True),
                    args.calls,
                    args.replays,
                )
                row["fused_over_unfused"] = row["fused_us"] / row["nccl_then_kernel_us"]
                if got_ll is not None:
                    row["ll_equal_unfused"] = [
                        bool(torch.equal(g.view(torch.uint8), v.view(torch.uint8)))
                        for g, v in zip(got_ll, want, strict=True)
                    ]
                    row["ll_fused_us"] = graph_us(
                        lambda x=x, residual=residual, w=w: ll.all_reduce_add_rmsnorm(x, residual, w, 1e-6, True),
                        args.calls,
                        args.replays,
                    )
            rows["fused"].append(row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", default="2", help="comma-separated group sizes")
    parser.add_argument("--hidden", type=lambda s: [int(h) for h in s.split(",")], default=[2048, 4096])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from compile_bench import gpu_report_header

    report = gpu_report_header("allreduce_bench")
    report["machine"]["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    report["runs"] = []
    for world in (int(t) for t in args.tp.split(",")):
        if world > torch.cuda.device_count():
            print(f"tp={world}: only {torch.cuda.device_count()} GPUs, skipped")
            continue
        out = f"/tmp/allreduce_bench_tp{world}.json"
        mp.spawn(_rank, args=(world, 29500 + world, args, out), nprocs=world)
        run = json.loads(Path(out).read_text())
        report["runs"].append(run)
        print(f"tp={world}: {run['all_reduce']}")
        print(f"{'KB':>6} {'nccl us':>8} {'1-shot us':>9} {'ratio':>6} {'2-shot us':>9} {'LL us':>6}  equal  same  LL=")
        for r in run["sizes"]:
            print(
                f"{r['kb']:>6} {r['nccl_us']:>8.2f} {r['one_shot_us']:>9.2f} {r['one_shot_over_nccl']:>6.2f} "
                f"{r['two_shot_us']:>9.2f} {r.get('ll_us', float('nan')):>6.2f}  "
                f"{r['bit_equal_nccl']!s:>5} {r['same_on_every_rank']!s:>5} {r.get('ll_bit_equal_one_shot', '-')!s:>5}"
                f"  (max diff {r['max_abs_diff_nccl']:.3g})"
            )
        print(
            f"{'T':>4} {'H':>5} {'nccl+kernel us':>14} {'custom+kernel':>13} {'fused us':>9} {'LL fused':>9} "
            f"{'ratio':>6}  equal (LL)"
        )
        for r in run["fused"]:
            if r["fused_taken"]:
                print(
                    f"{r['tokens']:>4} {r['hidden']:>5} {r['nccl_then_kernel_us']:>14.2f} "
                    f"{r['custom_then_kernel_us']:>13.2f} {r['fused_us']:>9.2f} "
                    f"{r.get('ll_fused_us', float('nan')):>9.2f} "
                    f"{r['fused_over_unfused']:>6.2f}  {r['equal_unfused']} {r.get('ll_equal_unfused', '-')}"
                )
        if args.out:
            args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
