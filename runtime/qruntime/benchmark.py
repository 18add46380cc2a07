"""Latency and throughput of an engine: TTFT, TPOT and tokens/s for a batch of equal prompts, and the
bandwidth floor of a decode step (what reading its bytes once costs at the GPU's copy bandwidth)."""

from __future__ import annotations

import math
import random
import time
from typing import Any

import torch

from qruntime.engine.engine import Engine
from qruntime.engine.sampling_params import SamplingParams

DTYPE_BYTES = {"F8_E4M3": 1, "F8_E4M3FNUZ": 1, "BF16": 2, "F16": 2, "F32": 4}


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `other` against `reference`, in dB (fp32 math; an
    exact match gives a large finite value)."""
    noise = (reference.float() - other.float()).pow(2).mean().clamp(min=1e-30)
    return float(10 * torch.log10(reference.float().pow(2).mean().clamp(min=1e-30) / noise))


def measure(
    engine: Engine, input_len: int, output_len: int, batch: int, seed: int | None = None, temperature: float = 0.0
) -> dict[str, Any]:
    """Generate `output_len` tokens (EOS ignored; greedy, or sampled at `temperature`) for `batch`
    random prompts of `input_len` tokens, all submitted at once. TTFT is the slowest request's; TPOT
    the mean over requests; decode tokens/s = batch / TPOT; output tokens/s counts every token over
    the whole run. A speculating engine's run also reports its drafts' acceptance_rate (accepted /
    proposed) and tokens_per_verification (tokens a verified sequence got from its step), this run's."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(engine.vocab_size) for _ in range(input_len)] for _ in range(batch)]
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=temperature)
    _sync(engine)
    before = engine.speculative_stats
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    _sync(engine)
    wall = time.perf_counter() - start
    after = engine.speculative_stats
    tpots = [o.timings.tpot for o in outputs if o.timings.tpot is not None]
    tpot = sum(tpots) / len(tpots) if tpots else math.nan
    row = {
        "batch": batch,
        "input_len": input_len,
        "output_len": output_len,
        "ttft_ms": max(o.timings.ttft for o in outputs) * 1e3,
        "tpot_ms": tpot * 1e3,
        "decode_tokens_per_s": batch / tpot if tpots else math.nan,
        "output_tokens_per_s": batch * output_len / wall,
        "wall_s": wall,
    }
    if before is not None and after is not None:
        drafted, accepted = after.drafted - before.drafted, after.accepted - before.accepted
        verifications, emitted = after.verifications - before.verifications, after.emitted - before.emitted
        row["acceptance_rate"] = accepted / drafted if drafted else 0.0
        row["tokens_per_verification"] = emitted / verifications if verifications else 0.0
    return row


def _sync(engine: Engine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)


def decode_step_bytes(manifest: dict[str, Any], batch: int = 1, context_len: int = 0) -> int:
    """Bytes a decode step must read at least: every weight once (the embedding table only for its
    `batch` rows, unless it is also the lm_head) plus the KV cache of `batch` contexts."""
    spec, kv = manifest["spec"], manifest["kv_cache"]
    total = 0
    own_head = any(name.startswith("lm_head.") for name in manifest["tensors"])  # `weight` or packed int4
    for info in manifest["tensors"].values():
        size = math.prod(info["shape"]) * DTYPE_BYTES[info["dtype"]]
        if info["role"] == "embedding" and not (spec["tie_word_embeddings"] and not own_head):
            size = batch * info["shape"][-1] * DTYPE_BYTES[info["dtype"]]
        total += size
    kv_elem = 1 if kv["dtype"] == "fp8_e4m3" else 2
    total += batch * context_len * 2 * kv["num_layers"] * kv["num_kv_heads"] * kv["head_dim"] * kv_elem
    return total


def copy_bandwidth(device: torch.device | str = "cuda", nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Measured device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    return 2 * nbytes * repeats / (start.elapsed_time(end) / 1e3)


def step_read_bytes(
    weights: dict[str, torch.Tensor],
    kv_bytes_per_token: int,
    batch: int,
    context_len: int,
    experts_read: int | None = None,
    tied_lm_head: bool = False,
) -> int:
    """Bytes one decode step of this process's weights must read at least, from the loaded tensors
    themselves (a tensor-parallel rank counts its own shards): every weight once, but the embedding
    only for its `batch` rows (unless it is also the lm_head), and of each stacked MoE expert tensor
    ([E, ...]) only the `experts_read` experts the step routes to (default: all); plus the KV cache
    of `batch` contexts of `context_len` tokens."""
    total = 0
    for name, tensor in weights.items():
        size = tensor.numel() * tensor.element_size()
        if "embed_tokens" in name and not tied_lm_head:
            size = batch * tensor.shape[-1] * tensor.element_size()
        elif ".experts." in name and tensor.dim() == 3 and experts_read is not None:
            size = size * min(experts_read, tensor.shape[0]) // tensor.shape[0]
        total += size
    return total + batch * context_len * kv_bytes_per_token
