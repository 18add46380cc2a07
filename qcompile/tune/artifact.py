"""`tune_artifact`: tune every GEMM and fused-MoE shape of an artifact on this GPU and record the winners.

For every PTPC-FP8 weight shape the FP8 GEMM (gemm.py), for every packed int4 weight shape the W4A16
GEMM (w4a16.py), for every stacked-expert shape the fused MoE kernel (moe.py), each at every
token-count bucket; for a tp = N > 1 artifact on a machine with N GPUs, the all-reduce's crossover
from the custom kernel to NCCL (allreduce.py; with fewer GPUs it is left out and the runtime keeps
its default). Writes kernels/<device>.json (docs/ARTIFACT.md)
and updates the manifest's file table in the same step, so `qcompile verify` still covers every
file; then records the kernels the tuned engine launches (builds.py). Needs a GPU.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from qruntime.artifact import read_manifest
from qruntime.kernel_configs import KERNELS_DIR, device_file

from qcompile.compile.manifest import write_listed_json
from qcompile.errors import QCompileError
from qcompile.tune.allreduce import tune_all_reduce
from qcompile.tune.builds import record_kernel_builds
from qcompile.tune.gemm import ROTATE_BYTES, TOKEN_BUCKETS, gemm_shapes, time_us, tune_gemm
from qcompile.tune.moe import moe_shapes, tune_moe
from qcompile.tune.w4a16 import table_key, tune_w4a16, w4a16_shapes


def tune_artifact(
    root: str | Path,
    buckets: Iterable[int] = TOKEN_BUCKETS,
    progress: Callable[[str], None] | None = None,
    record_builds: bool = True,
) -> Path:
    """Tune every GEMM (FP8 and W4A16) and fused-MoE shape of the artifact on the current GPU;
    returns the kernels/<device>.json written. record_builds: then record the kernels the tuned
    engine launches (kernel_builds/<device>.json, qcompile.tune.builds), which later loads on this
    GPU model build in parallel beside reading the weights."""
    if not torch.cuda.is_available():
        raise QCompileError("tuning needs a CUDA GPU (it times the runtime's kernels on it)")
    import triton

    root = Path(root)
    manifest = read_manifest(root)
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    entries = {}
    for n, k in gemm_shapes(manifest):
        entries[f"PTPCLinear:{n}x{k}"] = tune_gemm(n, k, list(buckets), device)
        if progress is not None:
            progress(f"PTPCLinear:{n}x{k}")
    for n, k, group in w4a16_shapes(manifest):
        entries[table_key(n, k)] = tune_w4a16(n, k, group, list(buckets), device)
        if progress is not None:
            progress(table_key(n, k))
    for shape in moe_shapes(manifest):
        entries[shape.key] = tune_moe(shape, list(buckets), device, time_us, ROTATE_BYTES)
        if progress is not None:
            progress(shape.key)
    tp = manifest.get("tp", 1)
    if tp > 1 and torch.cuda.device_count() >= tp:
        entries[f"AllReduce:tp{tp}"] = tune_all_reduce(tp)
        if progress is not None:
            progress(f"AllReduce:tp{tp}")
    elif tp > 1 and progress is not None:
        progress(f"AllReduce:tp{tp} not tuned: {torch.cuda.device_count()} GPU(s) here, the artifact runs on {tp}")
    table = {
        "device": name,
        "capability": list(torch.cuda.get_device_capability(device)),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "entries": entries,
    }
    path = write_listed_json(root, manifest, f"{KERNELS_DIR}/{device_file(name)}", table)
    if record_builds:
        record_kernel_builds(root, progress=progress)
    return path
