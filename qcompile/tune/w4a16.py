"""Tuning of the W4A16 GEMM (kernels/w4a16_gemm.py), a part of `qcompile tune`.

For every packed int4 weight shape a `W4A16Linear` reads (N, K and its group size) and every
token-count bucket: time the runtime's kernel over its candidate configs (sweep_configs: plain and
swapped tiles, and at one token the GEMVs beside them) on fresh random weights
(any int32 bits are valid codes), each call on its own weight copy as the FP8 GEMM's tuning does,
check the winner against the reference op's math, and return table entries under the key the
runtime's fast op looks up (`W4A16Linear:{N}x{K}`). Needs a GPU for real timings; w4a16_shapes and
the loop itself run anywhere (the kernel under Triton's interpreter on CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from qruntime.manifest_schema import QUANT_PARAM_ROLES

from qcompile.compile.manifest import rank_tensors
from qcompile.errors import QCompileError
from qcompile.quant import get_scheme
from qcompile.tune.gemm import ROTATE_BYTES, time_us

MAX_ERROR = 2**-7  # max |y - ref| / max |ref|: a bf16 output is off by ~2^-8 at most; a wrong kernel by ~1


def table_key(n: int, k: int) -> str:
    """The kernel-table key the runtime's W4A16Linear op looks up (K: the logical input columns)."""
    return f"W4A16Linear:{n}x{k}"


def w4a16_shapes(manifest: dict[str, Any]) -> list[tuple[int, int, int]]:
    """(N, K, group_size) of every 2-D packed int4 weight a W4A16Linear reads (stacked MoE experts
    run the reference op), as one GPU holds it (a rank's slice at tp > 1). Raises QCompileError when
    one (N, K) comes with two group sizes (they would share a table key)."""
    shapes: dict[tuple[int, int], int] = {}
    for name, info in rank_tensors(manifest).items():
        scheme = get_scheme(info["scheme"])
        if scheme.linear_op != "W4A16Linear" or info["role"] in QUANT_PARAM_ROLES or len(info["shape"]) != 2:
            continue
        n, words = info["shape"]
        group = scheme.int4.group_size
        if shapes.setdefault((n, words * 8), group) != group:
            raise QCompileError(f"manifest: {name} [{n}, {words * 8}] has two int4 group sizes in the artifact")
    return sorted((n, k, group) for (n, k), group in shapes.items())


def tune_w4a16(
    n: int,
    k: int,
    group_size: int,
    buckets: Iterable[int],
    device: torch.device,
    timer: Callable[[list[Callable[[], Any]]], float] = time_us,
    rotate_bytes: int = ROTATE_BYTES,
) -> dict[str, dict[str, Any]]:
    """bucket -> the fastest W4A16 GEMM config for x [m, k] bf16 times the int4 weight [n, k], with
    its µs and the default config's (`timer` times a list of calls back to back, each on its own
    weight copy)."""
    from qruntime.kernels.w4a16_gemm import default_config, sweep_configs, w4a16_gemm
    from qruntime.ops.functional import dequantize_int4
    from triton.runtime.errors import OutOfResources

    copies = []
    for _ in range(max(2, -(-rotate_bytes // (n * k // 2)))):
        w = torch.randint(-(1 << 31), 1 << 31, (n, k // 8), device=device, dtype=torch.int32)
        ws = (torch.rand(n, k // group_size, device=device) * 0.01 + 0.005).to(torch.bfloat16)
        copies.append((w, ws))
    w, ws = copies[0]
    weight = dequantize_int4(w, ws, group_size).float()  # the reference's weight, exact in fp32
    table: dict[str, dict[str, Any]] = {}
    for m in buckets:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        reference = x.float() @ weight.T
        timed = []
        for config in sweep_configs(m, n, k, group_size):
            try:
                calls = [lambda c=c, config=config, x=x: w4a16_gemm(x, *c, group_size, config) for c in copies]
                us = timer(calls)
            except OutOfResources:  # e.g. a pipeline deeper than shared memory holds: not a candidate here
                continue
            timed.append((us, config))
        if not timed:
            raise QCompileError(f"no W4A16 GEMM config runs for {table_key(n, k)} at {m} tokens")
        best_us, best = min(timed, key=lambda t: t[0])
        out = w4a16_gemm(x, w, ws, group_size, best).float()
        error = float((out - reference).abs().max() / reference.abs().max().clamp(min=1e-30))
        if not error <= MAX_ERROR:
            raise QCompileError(f"tuned W4A16 GEMM {n}x{k} at {m} tokens ({best}) is wrong: relative error {error:.3g}")
        default = default_config(m, n, k, group_size)
        default_us = next((us for us, c in timed if c == default), float("nan"))
        table[str(m)] = {
            "backend": "triton",
            **best.to_dict(),
            "us": round(best_us, 2),
            "default_us": round(default_us, 2),
        }
    return table
