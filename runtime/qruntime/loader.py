"""`load(path)`: an artifact directory -> a ready Engine (manifest checked, plan bound, cache sized)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import onnx
import torch

from qruntime.artifact import ArtifactFormatError, check_relative_path, read_manifest, verify_files
from qruntime.engine.cuda_graphs import DEFAULT_BUCKETS, DecodeGraphs
from qruntime.engine.engine import Engine
from qruntime.engine.model_runner import ModelRunner
from qruntime.engine.scheduler import Scheduler, SchedulerConfig
from qruntime.hub import is_hub_url, pull
from qruntime.kernel_configs import load_kernel_table
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.ops.base import OpEnv
from qruntime.ops.registry import reference_ops, triton_ops
from qruntime.plan import Plan, PlanError
from qruntime.tokenizer import Tokenizer, TokenizerError
from qruntime.weights import load_initializers

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CPU_KV_BUDGET = 512 << 20  # default cache bytes on CPU (a GPU uses what is free after the weights)
GPU_HEADROOM = 0.10  # share of GPU memory left for activations when sizing the cache


def _resolve_dtype(dtype: torch.dtype | str | None, manifest: dict) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or manifest["spec"].get("dtype", "bfloat16")
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """cuda when available by default; a device this machine does not have is a ValueError."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a torch device (cpu, cuda, cuda:1 ...)") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA device is available (torch {torch.__version__})")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: the runtime runs on cpu or cuda")
    return resolved


def _check_files(root: Path, manifest: dict, verify: bool) -> None:
    """Every listed file must exist with its size (cheap, always); with verify, its sha256 too."""
    if verify:
        problems = [str(p) for p in verify_files(root, manifest)]
    else:
        problems = []
        for rel, info in manifest["files"].items():
            path = root / check_relative_path(rel)
            if not path.is_file():
                problems.append(f"{rel}: missing")
            elif path.stat().st_size != info.get("bytes"):
                problems.append(f"{rel}: size {path.stat().st_size} != manifest {info.get('bytes')}")
    if problems:
        raise ArtifactFormatError(f"{root}: the artifact does not match its manifest:\n  " + "\n  ".join(problems))


def _num_blocks(spec: KVCacheSpec, dtype, device, max_model_len, max_num_seqs, num_kv_blocks, kv_cache_memory) -> int:
    if num_kv_blocks is not None:
        return num_kv_blocks
    per_block = spec.block_bytes(dtype)
    if kv_cache_memory is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            kv_cache_memory = int(free - GPU_HEADROOM * total)
        else:
            wanted = max_num_seqs * -(-max_model_len // spec.block_size) * per_block
            kv_cache_memory = min(CPU_KV_BUDGET, wanted)
    return max(kv_cache_memory // per_block, 0)


TRITON_DTYPES = (torch.bfloat16, torch.float16)  # what the Triton kernels compute in


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """ "auto" -> "triton" on CUDA in bf16/fp16, else "reference"; an explicit choice is checked."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and dtype in TRITON_DTYPES else "reference"
    if backend not in ("reference", "triton"):
        raise ValueError(f"backend {backend!r} is not one of 'auto', 'reference', 'triton'")
    if backend == "triton" and device.type != "cuda":
        raise ValueError("backend 'triton' runs on a CUDA device")
    if backend == "triton" and dtype not in TRITON_DTYPES:
        raise ValueError(f"backend 'triton' computes in bf16 or fp16, not {dtype}; use backend 'reference' for it")
    return backend


def load(
    path: str | Path,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    verify: bool = False,
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    num_kv_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    backend: str = "auto",
    cuda_graphs: bool | None = None,
) -> Engine:
    """Load a qcompile artifact and return an Engine.

    path: an artifact directory, or "hf://namespace/name[@revision]" on the Hugging Face Hub, which
    is pulled into the Hugging Face cache and verified file by file first (qruntime.hub.pull).
    device: "cuda" when available, else "cpu" by default. dtype: the compute dtype (default the
    model's, bf16 for Qwen3; float32 gives a tight reference). verify: check every file's sha256
    against the manifest first. The KV cache gets `num_kv_blocks` blocks, or `kv_cache_memory` bytes,
    or by default what the GPU has free after the weights (less 10% headroom) / up to 512 MiB on CPU.
    max_model_len defaults to the model's context, capped by what the cache holds.
    backend: "reference" (torch ops, any device), "triton" (the GPU fast path: Triton kernels with
    the artifact's tuned configs for this GPU, cuBLASLt where the tuner chose it; bf16 or fp16), or
    "auto" (triton on CUDA in bf16/fp16, reference otherwise: fp32 is the reference path's).
    cuda_graphs: replay decode steps from captured graphs (default: on with the triton backend when
    every op of the graph can be captured).
    """
    if is_hub_url(path):
        root = pull(path)
        verify = False  # pull has checked every file's sha256
    else:
        root = Path(path)
    manifest = read_manifest(root)
    if manifest.get("tp", 1) != 1:
        raise ArtifactFormatError(f"{root}: sharded for tp={manifest['tp']}; this runtime loads tp=1 artifacts")
    device = resolve_device(device)
    compute_dtype = _resolve_dtype(dtype, manifest)
    backend = resolve_backend(backend, device, compute_dtype)
    _check_files(root, manifest, verify)
    graph_path = root / manifest.get("graph", {}).get("file", "graph.onnx")
    try:
        graph = onnx.load(str(graph_path), load_external_data=False).graph
    except Exception as exc:  # onnx raises DecodeError / OSError variants
        raise ArtifactFormatError(f"{graph_path}: cannot be read as ONNX ({exc})") from exc
    try:
        kv_spec = KVCacheSpec.from_manifest(manifest["kv_cache"])
        spec = manifest["spec"]
        vocab_size, context = int(spec["vocab_size"]), int(spec["max_position_embeddings"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactFormatError(f"{root / 'manifest.json'}: bad spec / kv_cache entry ({exc!r})") from exc
    if max_model_len is not None and not 1 < max_model_len <= context:
        raise ValueError(f"max_model_len {max_model_len} must be in 2..{context} (the model's context)")
    try:
        tokenizer = Tokenizer.from_dir(root)
    except TokenizerError as exc:
        raise ArtifactFormatError(str(exc)) from exc

    kernels = None
    if backend == "triton":
        gpu = torch.cuda.get_device_name(device)
        kernels = load_kernel_table(root, gpu)
        if kernels is None:
            warnings.warn(
                f"{root}: no tuned kernel configs for {gpu}; using default configs (`qcompile tune` makes them)",
                stacklevel=2,
            )
    registry = triton_ops() if backend == "triton" else reference_ops()
    weights = load_initializers(root, graph, device, compute_dtype)
    try:
        plan = Plan.build(graph, weights, OpEnv(compute_dtype, device, kv_spec, kernels), registry)
    except PlanError as exc:
        raise ArtifactFormatError(f"{graph_path}: {exc}") from exc

    wanted_len = max_model_len or context
    blocks = _num_blocks(kv_spec, compute_dtype, device, wanted_len, max_num_seqs, num_kv_blocks, kv_cache_memory)
    capacity = blocks * kv_spec.block_size
    if max_model_len is None:
        max_model_len = min(context, capacity)
    if capacity < max_model_len or max_model_len < 2:
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({blocks} block(s) of {kv_spec.block_size}), less than "
            f"max_model_len {max_model_len}: give more num_kv_blocks / kv_cache_memory or a smaller max_model_len"
        )
    if cuda_graphs is None:
        cuda_graphs = backend == "triton" and plan.capturable
    if cuda_graphs and not plan.capturable:
        raise ValueError("cuda_graphs=True but some ops of this graph cannot be captured (MoE, reference attention)")
    # one block more than the scheduler hands out: the scratch block padded graph rows write to
    kv_cache = KVCache(kv_spec, blocks + int(cuda_graphs), compute_dtype, device)
    config = SchedulerConfig(
        num_blocks=blocks,
        block_size=kv_spec.block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    description: dict[str, Any] = {
        "artifact": str(path) if is_hub_url(path) else str(root),
        "device": str(device),
        "dtype": str(compute_dtype).removeprefix("torch."),
        "kv_cache": f"{kv_spec.layout.name} {kv_spec.kv_dtype}, {blocks} blocks x {kv_spec.block_size}",
        "max_model_len": max_model_len,
    }
    graphs = None
    if cuda_graphs:
        buckets = [b for b in DEFAULT_BUCKETS if b <= max_num_seqs] or [max_num_seqs]
        graphs = DecodeGraphs(plan, kv_cache, blocks, max_model_len, buckets)
        description["cuda_graphs"] = list(graphs.buckets)
    description["backend"] = backend
    return Engine(
        ModelRunner(plan, kv_cache, device, max_model_len, graphs),
        Scheduler(config),
        tokenizer,
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        description=description,
    )
