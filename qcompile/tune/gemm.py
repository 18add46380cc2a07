"""Tuning of the FP8 GEMM: for one PTPC-FP8 weight shape (N, K) and every token-count bucket, time the
runtime's Triton FP8 GEMM over its candidate configs and torch._scaled_mm (cuBLASLt) and check the
winner against the reference math. Needs a GPU. (`time_us` is shared with the MoE tuner.)
Where split-K configs compete, the GEMM is timed a second time without their reduction launch, as
it runs when the next kernel sums its partials (ops/triton_ops.fold_split_k_reductions); that
winner, when it differs, is the bucket's "folded" entry, which such a GEMM takes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from qcompile.compile.manifest import rank_tensors
from qcompile.errors import QCompileError
from qcompile.quant import get_scheme

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def gemm_shapes(manifest: dict[str, Any]) -> list[tuple[int, int]]:
    """(N, K) of every 2-D weight a PTPCLinear reads (ptpc-fp8, tensor-fp8; stacked MoE experts are
    tuned with the MoE kernel): of a rank's slice at tp > 1, the GEMMs each GPU runs (every rank's
    slices have the same shapes)."""
    shapes = {
        tuple(info["shape"])
        for name, info in rank_tensors(manifest).items()
        if get_scheme(info["scheme"]).linear_op == "PTPCLinear" and info["role"] != "scale" and len(info["shape"]) == 2
    }
    return sorted(shapes)


ROTATE_BYTES = 256 << 20  # weight copies cycled through per timing: well past any GPU's L2 cache


def time_us(calls: list[Callable[[], Any]], replays: int = 5) -> float:
    """µs per call of `calls` run back to back from a captured CUDA graph, as the runtime's decode
    steps run: no launch gaps, and each call reads a different weight copy, so weights come from
    HBM, not from an L2 warmed by the call before (nor cooled by a cache flush). Median of replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compile / pick algorithms outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def _candidates(xq, xs, w, ws, ws_row, folded: bool = False) -> dict[str, tuple[dict[str, Any], Callable[..., Any]]]:
    """label -> (table entry, a call running it on a weight copy (w, ws, ws_row)) for cuBLASLt and
    each candidate Triton config. folded: split-K configs stop at their partials (no reduction
    launch: what a GEMM whose reader sums them runs, ops/triton_ops.fold_split_k_reductions)."""
    from qruntime.kernels.fp8_gemm import default_config, ptpc_fp8_gemm, sweep_configs

    (m, k), n = xq.shape, w.shape[0]
    out = {}
    if xq.device.type == "cuda":
        out["cublaslt"] = (
            {"backend": "cublaslt"},
            lambda w, ws, ws_row: torch._scaled_mm(xq, w.T, scale_a=xs, scale_b=ws_row, out_dtype=torch.bfloat16),
        )
    for config in {default_config(m, n, k), *sweep_configs(m, n, k)}:
        out[repr(config)] = (
            {"backend": "triton", **config.to_dict()},
            lambda w, ws, ws_row, config=config: ptpc_fp8_gemm(
                xq, xs, w, ws, out_dtype=torch.bfloat16, config=config, defer_reduce=folded
            ),
        )
    return out


def _launch(entry: dict[str, Any]) -> dict[str, Any]:
    """A table entry without its timings: what the runtime runs."""
    return {key: value for key, value in entry.items() if not key.endswith("_us") and key != "us"}


def _output(result) -> torch.Tensor:
    """A candidate's [M, N] output (split-K partials reduced)."""
    return result if isinstance(result, torch.Tensor) else result.reduce()


def tune_gemm(
    n: int,
    k: int,
    buckets: Iterable[int],
    device: torch.device,
    timer: Callable[[list[Callable[[], Any]]], float] = time_us,
    rotate_bytes: int = ROTATE_BYTES,
) -> dict[str, dict[str, Any]]:
    """bucket -> the fastest backend/config for an [m, k] x [n, k]ᵀ PTPC-FP8 GEMM, with its µs
    (`timer` times a list of calls back to back, each on its own weight copy; cuBLASLt competes on
    a GPU). A bucket where split-K configs compete also gets the winner timed without their
    reduction launch as "folded", when that is another config."""
    from qruntime.ops.functional import dynamic_quant, ptpc_linear

    copies = []
    for _ in range(max(2, -(-rotate_bytes // (n * k)))):
        w = (torch.randn(n, k, device=device) * 0.05).to(torch.float8_e4m3fn)
        ws = (torch.rand(n, 1, device=device) * 1e-3 + 1e-4).to(torch.bfloat16)
        copies.append((w, ws, ws.float().reshape(1, -1).contiguous()))
    w, ws, ws_row = copies[0]
    table: dict[str, dict[str, Any]] = {}
    for m in buckets:
        xq, xs = dynamic_quant(torch.randn(m, k, device=device, dtype=torch.bfloat16), 0)
        reference = ptpc_linear(xq, xs, w, ws, torch.float32)
        chosen = {}
        for folded in (False, True):
            candidates = _candidates(xq, xs, w, ws, ws_row, folded)
            if folded and not any(c.get("split_k", 1) > 1 for c, _ in candidates.values()):
                break  # no split-K candidate: nothing to fold
            timed = sorted(
                (timer([lambda c=c, fn=fn: fn(*c) for c in copies]), key) for key, (_, fn) in candidates.items()
            )
            best_us, best = timed[0]
            entry, fn = candidates[best]
            out = _output(fn(w, ws, ws_row)).float()
            error = float((out - reference).abs().max() / reference.abs().max().clamp(min=1e-30))
            if error > 2**-7:  # a bf16 output is off by at most ~2^-8 relative
                raise QCompileError(f"tuned GEMM {n}x{k} at {m} tokens ({best}) is wrong: relative error {error:.3g}")
            chosen[folded] = {**entry, "us": round(best_us, 2)}
            if "cublaslt" in candidates:
                chosen[folded]["cublaslt_us"] = round(next(t for t, label in timed if label == "cublaslt"), 2)
        table[str(m)] = chosen[False]
        if True in chosen and _launch(chosen[True]) != _launch(chosen[False]):
            table[str(m)]["folded"] = chosen[True]
    return table
