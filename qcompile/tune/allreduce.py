"""Tuning of a tp > 1 artifact's all-reduce: on this host's first tp GPUs (one spawned process each,
NCCL with NVLink multicast off), time the custom one-shot kernel over peer memory
(qruntime.comm.all_reduce) against NCCL at every message size of SIZES, each from a CUDA graph of
back-to-back calls as decode steps run them, and keep the crossover: the largest size up to which the
custom kernel was faster at every size. Stored as the table entry "AllReduce:tp<N>" (one bucket,
`max_custom_bytes`, with the timings beside it); the runtime reads it at load (qruntime/rank.py).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from qcompile.errors import QCompileError

SIZES = tuple(4096 << i for i in range(11))  # 4 KiB .. 4 MiB
CALLS, REPLAYS = 20, 20


def graph_us(fn, calls: int = CALLS, replays: int = REPLAYS) -> float:
    """Mean µs of one call of fn, from a CUDA graph of `calls` calls replayed `replays` times (every
    rank of the group runs the same sequence: the collectives inside pair up)."""
    import torch.distributed as dist

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def crossover(timings: list[dict[str, float]]) -> int:
    """The largest `bytes` up to which the custom kernel beat NCCL at every size (0: never)."""
    best = 0
    for row in sorted(timings, key=lambda r: r["bytes"]):
        if row["custom_us"] >= row["nccl_us"]:
            break
        best = row["bytes"]
    return best


def _rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from qruntime.comm.all_reduce import AllReducePolicy, AllReducer

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world, device_id=device)
    try:
        group = dist.group.WORLD
        reducer = AllReducer.create(group, device, AllReducePolicy(max_custom_bytes=max(SIZES)))
        rows: list[dict[str, Any]] = []
        warm = torch.ones(1 << 20, device=device)
        for _ in range(500):  # clocks up, NCCL's channels made
            dist.all_reduce(warm, group=group)
        for size in SIZES:
            buf = torch.ones(size // 2, dtype=torch.bfloat16, device=device)
            row: dict[str, Any] = {
                "bytes": size,
                "nccl_us": graph_us(lambda buf=buf: dist.all_reduce(buf, group=group)),
            }
            if reducer.regions is not None:
                row["custom_us"] = graph_us(lambda buf=buf: reducer.all_reduce(buf))
            rows.append(row)
        if rank == 0:
            torch.save({"rows": rows, "unavailable": reducer.unavailable}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def tune_all_reduce(tp: int) -> dict[str, dict[str, Any]]:
    """The "AllReduce:tp<N>" bucket: {"1": {"max_custom_bytes": ..., "timings_us": [...]}}."""
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < tp:
        raise QCompileError(
            f"tuning the tp={tp} all-reduce needs {tp} GPUs; this machine has {torch.cuda.device_count()}"
        )
    with tempfile.TemporaryDirectory(prefix="qcompile-tune-ar-") as tmp:
        out = str(Path(tmp) / "timings.pt")
        mp.spawn(_rank, args=(tp, f"file://{Path(tmp) / 'store'}", out), nprocs=tp)
        result = torch.load(out)
    rows = result["rows"]
    best = crossover(rows) if all("custom_us" in r for r in rows) else 0
    note = {} if result["unavailable"] == "" else {"custom_unavailable": result["unavailable"]}
    return {"1": {"max_custom_bytes": best, "timings_us": rows, **note}}
