"""Tuning of a tp > 1 artifact's all-reduce: on this host's first tp GPUs (one spawned process each,
NCCL with NVLink multicast off), time the LL, one-shot and two-shot kernels over peer memory
(qruntime.comm.all_reduce) against NCCL at every message size of SIZES (LL up to LL_SIZES' largest),
each from a CUDA graph of back-to-back calls as decode steps run them, and keep where each wins
(`thresholds`). Stored as the table entry "AllReduce:tp<N>" (one bucket: `max_ll_bytes`,
`max_one_shot_bytes`, `max_two_shot_bytes`, the timings beside them); the runtime reads it at load
(qruntime/rank.py).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from qcompile.errors import QCompileError
from qcompile.tune.gemm import time_us

SIZES = tuple(4096 << i for i in range(11))  # 4 KiB .. 4 MiB
LL_SIZES = (2048, *SIZES[:5])  # 2 KiB (one row of 1024 bf16) .. 64 KiB: the LL kernel's candidates
CALLS, REPLAYS = 20, 20


def graph_us(fn, calls: int = CALLS, replays: int = REPLAYS) -> float:
    """µs of one call of fn, from a CUDA graph of `calls` back-to-back calls (the tuners' time_us,
    median of `replays` replays). Every rank of the group runs the same sequence, so the collectives
    inside pair up; a rank that starts a replay late shows in one replay, not in the median."""
    return time_us([fn] * calls, replays)


def thresholds(timings: list[dict[str, float]]) -> tuple[int, int, int]:
    """(max_ll_bytes, max_one_shot_bytes, max_two_shot_bytes): from the smallest size up, the LL
    kernel while it is the fastest of the four, then the one-shot while it is the fastest of the
    rest, then the two-shot while it beats NCCL; each limit the last size of its unbroken run (0:
    none; each at least the one before it, so a size past LL's run is the one-shot's at the latest)."""

    def fastest(row: dict[str, float], kinds: tuple[str, ...]) -> str:
        return min(kinds, key=lambda k: row.get(k, float("inf")))

    rows = sorted(timings, key=lambda r: r["bytes"])
    ll = i = 0
    while i < len(rows) and fastest(rows[i], ("ll_us", "one_shot_us", "two_shot_us", "nccl_us")) == "ll_us":
        ll = rows[i]["bytes"]
        i += 1
    one = two = ll
    while i < len(rows) and fastest(rows[i], ("one_shot_us", "two_shot_us", "nccl_us")) == "one_shot_us":
        one = two = rows[i]["bytes"]
        i += 1
    while i < len(rows) and rows[i].get("two_shot_us", float("inf")) < rows[i]["nccl_us"]:
        two = rows[i]["bytes"]
        i += 1
    return ll, one, two


def _rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from qruntime.comm.all_reduce import AllReducePolicy, AllReducer

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world, device_id=device)
    try:
        group = dist.group.WORLD
        # each reducer takes its kernel alone (the defaults would send small messages to LL)
        one_shot = AllReducer.create(group, device, AllReducePolicy(max_one_shot_bytes=max(SIZES), max_ll_bytes=0))
        two_shot = AllReducer.create(
            group, device, AllReducePolicy(max_one_shot_bytes=0, max_two_shot_bytes=max(SIZES), max_ll_bytes=0)
        )
        ll = AllReducer.create(group, device, AllReducePolicy(max_one_shot_bytes=0, max_ll_bytes=max(LL_SIZES)))
        rows: list[dict[str, Any]] = []
        warm = torch.ones(1 << 20, device=device)
        for _ in range(500):  # clocks up, NCCL's channels made
            dist.all_reduce(warm, group=group)
        for size in sorted({*LL_SIZES, *SIZES}):
            buf = torch.ones(size // 2, dtype=torch.bfloat16, device=device)
            row: dict[str, Any] = {
                "bytes": size,
                "nccl_us": graph_us(lambda buf=buf: dist.all_reduce(buf, group=group)),
            }
            kernels = [("one_shot_us", one_shot), ("two_shot_us", two_shot)]
            for name, reducer in kernels + ([("ll_us", ll)] if size in LL_SIZES else []):
                if reducer.regions is not None:
                    row[name] = graph_us(lambda buf=buf, reducer=reducer: reducer.all_reduce(buf))
            rows.append(row)
        if rank == 0:
            torch.save({"rows": rows, "unavailable": one_shot.unavailable}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def tune_all_reduce(tp: int) -> dict[str, dict[str, Any]]:
    """The "AllReduce:tp<N>" bucket: {"1": {"max_ll_bytes": ..., "max_one_shot_bytes": ...,
    "max_two_shot_bytes": ..., "timings_us": [...]}}."""
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
    ll, one, two = thresholds(rows)  # all 0 where peer memory was unavailable (NCCL's rows only)
    note = {} if result["unavailable"] == "" else {"custom_unavailable": result["unavailable"]}
    limits = {"max_ll_bytes": ll, "max_one_shot_bytes": one, "max_two_shot_bytes": two}
    return {"1": {**limits, "timings_us": rows, **note}}
