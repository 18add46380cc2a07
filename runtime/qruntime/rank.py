"""One rank's model: its graph and weights loaded, its plan bound, its KV cache sized and allocated,
its decode steps captured, and the other steps as whole-step (mixed) and piecewise graphs.

tp=1 builds rank 0 alone. At tp=N every rank runs `build_rank` (rank 0 in the caller's process,
ranks 1..N-1 in spawned workers, engine/workers.py) and they meet at checkpoints: "loaded" (graph
and weights read: what a bad file breaks), "planned" (process group joined, plan bound), "kernels"
(the artifact's recorded kernels built beside the weights, qruntime.kernel_prebuild), "ready"
(cache allocated, graphs captured). Rank 0 passes a checkpoint only when every worker reports it, so
a rank that fails is reported, with its traceback, before any rank waits in a collective for it.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import MappingProxyType

import onnx
import torch
import torch.distributed as dist

from qruntime.artifact import ArtifactFormatError, artifact_path
from qruntime.comm.all_reduce import AllReducePolicy, AllReducer
from qruntime.early_prebuild import EarlyPrebuild
from qruntime.engine.cuda_graphs import DEFAULT_BUCKETS, DecodeGraphs
from qruntime.engine.graph_capture import cuda_capture
from qruntime.engine.mixed_graphs import MixedGraphs, mixed_unfit_reason
from qruntime.engine.model_runner import ModelRunner
from qruntime.engine.piecewise_graphs import PiecewiseGraphs, token_buckets, unfit_reason
from qruntime.engine.sharded_sampler import VocabShard
from qruntime.engine.sharded_sampler import warm_up as warm_up_sampling
from qruntime.engine.warm_up import warm_up_steps
from qruntime.kernel_configs import KernelTable, load_kernel_table
from qruntime.kernel_prebuild import Prebuild, PrebuildReport, default_jobs, start_prebuild
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.ops.base import OpEnv
from qruntime.ops.collective import AllGather
from qruntime.ops.registry import reference_ops, triton_ops
from qruntime.plan import Plan, PlanError
from qruntime.synthetic import random_initializers
from qruntime.target import DEFAULT_TARGET, get_target
from qruntime.weights import load_initializers

CPU_KV_BUDGET = 512 << 20  # default cache bytes on CPU (a GPU uses what is free after the weights)
GPU_HEADROOM = 0.10  # share of GPU memory left for activations when sizing the cache
GROUP_TIMEOUT = timedelta(minutes=10)  # longest wait of one collective (or the group's rendezvous)

# "first-use": each graph bucket is captured at its first step, or while the engine is idle
# (ModelRunner.idle_work), the warm-up steps run then too; "load": all of them before load returns
GRAPH_CAPTURE = ("first-use", "load")

Checkpoint = Callable[[str], None]


@dataclass(frozen=True)
class RankConfig:
    """What every rank needs to build its runner: plain data, pickled to the spawned workers."""

    root: Path
    graph_files: tuple[str, ...]  # rank r's graph, relative to root; one per rank
    listed: frozenset[str]  # the manifest's files: the only ones read (qruntime.artifact.artifact_path)
    kv_spec: KVCacheSpec
    device: torch.device  # tp=1: the device; tp>1 on CUDA: rank r runs on cuda:r
    dtype: torch.dtype
    backend: str  # "reference" | "triton" (resolved)
    context: int  # the model's max_position_embeddings
    max_model_len: int | None
    max_num_seqs: int
    max_num_batched_tokens: int  # the most tokens a step holds: the largest piecewise-graph bucket
    num_kv_blocks: int | None
    kv_cache_memory: int | None
    cuda_graphs: bool | None
    synthetic: bool = False  # random weights made on the device instead of read (qruntime.synthetic)
    custom_all_reduce: bool = True  # tp > 1, triton backend: small messages through peer memory (qruntime.comm)
    sharded_sampling: bool = True  # tp > 1, vocabulary-parallel head: sample the ranks' shards, not gathered rows
    pdl: bool = False  # triton backend: programmatic dependent launch (kernels/pdl.py), resolved by load
    target: str = DEFAULT_TARGET  # the artifact's compile target (qruntime.target): the fast path's FP8 format
    small_step_graphs: bool = False  # whole-step graphs for 8..64-token steps too (VERIFY_BUCKETS: speculation)
    prebuild_kernels: bool = True  # build the artifact's recorded kernels while the weights load (kernel_prebuild)
    graph_capture: str = "first-use"  # GRAPH_CAPTURE: when the CUDA graphs are captured (build_rank)

    @property
    def tp(self) -> int:
        return len(self.graph_files)

    def device_of(self, rank: int) -> torch.device:
        if self.tp == 1 or self.device.type == "cpu":
            return self.device
        return torch.device("cuda", rank)


@dataclass(frozen=True)
class Rank:
    """A built rank: its runner and the sizes every rank agreed on."""

    runner: ModelRunner
    num_blocks: int  # KV blocks the scheduler hands out (the cache holds one more with CUDA graphs)
    max_model_len: int
    graph_buckets: tuple[int, ...] | None  # batch sizes of the captured decode graphs
    piecewise_buckets: tuple[int, ...] | None = None  # token counts of the piecewise graphs (other steps)
    mixed_buckets: tuple[int, ...] | None = None  # token counts of the whole-step graphs of other steps
    all_reduce: AllReducer | None = None  # how tp > 1 sums over the ranks on the fast path
    prebuild: PrebuildReport | None = None  # the recorded kernels built beside the load, when it had a list
    graph_seconds: Mapping[str, float] = field(default_factory=dict)  # kv_cache, each kind of graph, warm_up_steps


def _no_checkpoint(tag: str) -> None:
    pass


def read_graph(path: Path) -> onnx.GraphProto:
    """A graph file's nodes and initializers (the weights stay in their safetensors shards)."""
    try:
        return onnx.load(str(path), load_external_data=False).graph
    except Exception as exc:  # onnx raises DecodeError / OSError variants
        raise ArtifactFormatError(f"{path}: cannot be read as ONNX ({exc})") from exc


def init_group(config: RankConfig, rank: int, store: dist.Store) -> dist.ProcessGroup:
    """Join the default process group of the config's tp ranks: NCCL on CUDA (rank r on cuda:r),
    gloo on CPU. NVLink multicast (NVLS) stays off: the lent multi-GPU machines do not support it,
    and NCCL reads the variable when the communicator is made."""
    device = config.device_of(rank)
    if device.type == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=config.tp, timeout=GROUP_TIMEOUT, device_id=device
        )
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=config.tp, timeout=GROUP_TIMEOUT)
    return dist.group.WORLD


def _kernels(config: RankConfig, device: torch.device, warn: bool) -> KernelTable | None:
    if config.backend != "triton" or device.type != "cuda":  # the CPU (Triton's interpreter): no tuned configs
        return None
    gpu = torch.cuda.get_device_name(device)
    kernels = load_kernel_table(config.root, gpu, config.listed)
    if kernels is None and warn:
        warnings.warn(
            f"{config.root}: no tuned kernel configs for {gpu}; using default configs (`qcompile tune` makes them)",
            stacklevel=5,  # load's caller
        )
    return kernels


def _start_prebuild(config: RankConfig, device: torch.device, early: EarlyPrebuild | None = None) -> Prebuild | None:
    """The artifact's recorded kernels building for this GPU (qruntime.kernel_prebuild), the cores
    shared among the ranks; None on the CPU, the reference path, or without a list for this GPU.
    `early`: a build started at the load's call (qruntime.early_prebuild), taken over when it was
    started for this artifact and device and this rank builds kernels ahead, else cancelled."""
    wanted = config.prebuild_kernels and config.backend == "triton" and device.type == "cuda" and not torch.version.hip
    if early is not None:
        if wanted and early.serves(config.root, device):
            return early.build.adopt() if early.build is not None else None  # None: it found no list
        early.cancel()
    if not wanted:
        return None
    name, capability = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
    return start_prebuild(config.root, config.listed, name, capability, max(1, default_jobs() // config.tp))


def _all_reduce_policy(config: RankConfig, kernels: KernelTable | None) -> AllReducePolicy:
    """The tuned limits of the LL, one-shot and two-shot kernels (`qcompile tune` on tp GPUs; a
    table from before the LL kernel has no LL limit: the default), else the defaults; none when
    custom_all_reduce is off. Every rank reads the same table: the same policy."""
    if not config.custom_all_reduce:
        return AllReducePolicy(max_one_shot_bytes=0, max_ll_bytes=0)
    tuned = kernels.lookup(f"AllReduce:tp{config.tp}", 1) if kernels is not None else None
    if tuned is None:
        return AllReducePolicy()
    ll = tuned.get("max_ll_bytes", AllReducePolicy.max_ll_bytes)
    return AllReducePolicy(tuned["max_one_shot_bytes"], tuned["max_two_shot_bytes"], max_ll_bytes=ll)


def _local_blocks(config: RankConfig, device: torch.device) -> int:
    """KV blocks this rank can hold: as asked, or what its memory allows."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    spec = config.kv_spec
    per_block = spec.block_bytes(config.dtype)
    memory = config.kv_cache_memory
    if memory is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            memory = int(free - GPU_HEADROOM * total)
        else:
            wanted_len = config.max_model_len or config.context
            memory = min(CPU_KV_BUDGET, config.max_num_seqs * -(-wanted_len // spec.block_size) * per_block)
    return max(memory // per_block, 0)


def _agree(device: torch.device, blocks: int, capturable: bool) -> tuple[int, bool]:
    """The minimum over ranks of the KV blocks each can hold, and whether every rank's plan can be captured."""
    values = torch.tensor([blocks, int(capturable)], dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MIN)
    return int(values[0]), bool(values[1])


def logits_shard(plan: Plan) -> Plan | None:
    """The plan without its last node when that node gathers the vocabulary-parallel head's logits
    (then its output is this rank's columns of them, [n, V / tp]); None for any other plan."""
    last = plan.nodes[-1] if plan.nodes else None
    if last is None or not isinstance(last.op, AllGather) or last.outputs != (plan.output,):
        return None
    return Plan(plan.nodes[:-1], plan.weights, last.inputs[0])


def vision_inputs(graph: onnx.GraphProto, dtype: torch.dtype) -> tuple[bool, tuple[int, torch.dtype] | None]:
    """A Qwen3-VL graph's (docs/vision.md): whether positions are [3, T] (M-RoPE), and the width and
    dtype of its vision_embeds input (None: a graph without one)."""
    dims = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in graph.input}
    mrope = len(dims.get("positions", ())) == 2
    width = dims.get("vision_embeds", [None, None])[1]
    if "vision_embeds" in dims and not (isinstance(width, int) and width > 0):
        raise ArtifactFormatError(f"graph input vision_embeds has no fixed width ({dims['vision_embeds']})")
    return mrope, None if width is None else (width, dtype)


def _warm_up(runner: ModelRunner, steps: list, shard: VocabShard | None, dtype: torch.dtype) -> None:
    """Run the warm-up steps (engine/warm_up.py) without the mixed graphs, whose kernels build at
    capture: the piecewise and eager steps' variants, which fresh long prompts and all-logits steps
    still meet, build here; then, every rank together, the sharded sampler's kernels."""
    mixed, runner.mixed_graphs = runner.mixed_graphs, None
    try:
        columns = [runner.execute(chunks).shape[1] for chunks in steps]
    finally:
        runner.mixed_graphs = mixed
    torch.cuda.synchronize(runner.device)
    if shard is not None and columns:
        warm_up_sampling(shard, columns[-1], dtype, runner.device)


def build_rank(
    config: RankConfig,
    rank: int = 0,
    store: dist.Store | None = None,
    checkpoint: Checkpoint = _no_checkpoint,
    early: EarlyPrebuild | None = None,
) -> Rank:
    """Build rank `rank`'s runner (see the module docstring); `store` rendezvous the tp > 1 group;
    `early`: its kernel build, started at the load's call (_start_prebuild; whoever started it
    cancels it if this fails first)."""
    device = config.device_of(rank)
    graph_path = artifact_path(config.root, config.graph_files[rank], listed=config.listed)
    graph = read_graph(graph_path)
    kernels = _kernels(config, device, warn=rank == 0)
    prebuild = _start_prebuild(config, device, early)
    try:  # the kernels build while the weights are read and the plan is bound
        if config.synthetic:
            weights = random_initializers(config.root, graph, device, config.dtype, config.listed)
        else:
            weights = load_initializers(config.root, graph, device, config.dtype, listed=config.listed)
        checkpoint("loaded")

        group = init_group(config, rank, store) if config.tp > 1 else None
        reducer = None
        if group is not None and config.backend == "triton":
            reducer = AllReducer.create(group, device, _all_reduce_policy(config, kernels))
        registry = triton_ops() if config.backend == "triton" else reference_ops()
        env = OpEnv(
            config.dtype,
            device,
            config.kv_spec,
            kernels,
            tp_group=group,
            all_reduce=reducer,
            pdl=config.pdl,
            fp8=get_target(config.target).fp8_dtype,
        )
        try:
            plan = Plan.build(graph, weights, env, registry)
        except PlanError as exc:
            raise ArtifactFormatError(f"{graph_path}: {exc}") from exc
        shard = None
        if group is not None and config.sharded_sampling and (sharded := logits_shard(plan)) is not None:
            plan, shard = sharded, VocabShard(rank, config.tp, group, reducer)
        if config.backend == "triton":
            from qruntime.ops.triton_ops import (
                fold_dynamic_quant,
                fold_router_norm,
                fold_split_k_reductions,
            )

            fold_split_k_reductions(plan)
            fold_dynamic_quant(plan)
            fold_router_norm(plan)
        blocks, capturable = _local_blocks(config, device), plan.capturable
        checkpoint("planned")
        report = prebuild.wait() if prebuild is not None else None  # before the first launch
    except BaseException:
        if prebuild is not None:  # a load that fails leaves no worker compiling
            prebuild.cancel()
        raise
    checkpoint("kernels")
    if group is not None:
        blocks, capturable = _agree(device, blocks, capturable)

    spec = config.kv_spec
    capacity = blocks * spec.block_size
    max_model_len = config.max_model_len or min(config.context, capacity)
    if capacity < max_model_len or max_model_len < 2:
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({blocks} block(s) of {spec.block_size}), less than "
            f"max_model_len {max_model_len}: give more num_kv_blocks / kv_cache_memory or a smaller max_model_len"
        )
    cuda_graphs = config.cuda_graphs
    if cuda_graphs is None:
        cuda_graphs = config.backend == "triton" and capturable
    if cuda_graphs and not capturable:
        raise ValueError("cuda_graphs=True but some ops of this graph cannot be captured (MoE, reference attention)")
    laps, lap_start = {}, [time.perf_counter()]

    def lap(tag: str) -> None:  # seconds of each part of the cache-and-graphs phase, for the load's report
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        laps[tag], lap_start[0] = round(now - lap_start[0], 3), now

    # one block more than the scheduler hands out: the scratch block padded graph rows write to
    kv_cache = KVCache(spec, blocks + int(cuda_graphs), config.dtype, device, get_target(config.target).fp8_dtype)
    graphs = piecewise = mixed = None
    mrope, vision = vision_inputs(graph, config.dtype)
    # every rank captures the same buckets in the same order: the graphs hold the all-reduces. Captured
    # at first use, the order is still the same on every rank: each rank runs the same steps, and idle
    # work comes at the same point of them (engine/workers.py)
    lazy = config.graph_capture == "first-use"
    if cuda_graphs:
        buckets = [b for b in DEFAULT_BUCKETS if b <= config.max_num_seqs] or [config.max_num_seqs]
        lap("kv_cache")
        # one memory pool for every graph: the step kinds never run at once (one stream, one step at a
        # time), so what a mixed step's graph frees inside it a piecewise or decode graph can use
        capture = cuda_capture(torch.cuda.graph_pool_handle())
        graphs = DecodeGraphs(
            plan, kv_cache, blocks, max_model_len, buckets, mrope=mrope, vision=vision, capture=capture, lazy=lazy
        )
        lap("decode_graphs")
        # a plan that mixes rows (per-tensor activation scales) runs its other steps eagerly instead (as
        # a Qwen3-VL engine runs its steps holding image rows)
        if unfit_reason(plan) is None:
            tokens = token_buckets(config.max_num_batched_tokens, verify=config.small_step_graphs)
            piecewise = PiecewiseGraphs(
                plan, kv_cache, tokens, blocks, max_model_len, capture, mrope, vision, lazy=lazy
            )
            lap("piecewise_graphs")
            if mixed_unfit_reason(plan) is None:  # whole-step graphs where attention launches from bounds
                mixed = MixedGraphs(
                    plan,
                    kv_cache,
                    tokens,
                    blocks,
                    max_model_len,
                    config.max_num_seqs,
                    capture,
                    mrope,
                    vision,
                    lazy=lazy,
                )
                lap("mixed_graphs")
    runner = ModelRunner(plan, kv_cache, device, max_model_len, graphs, piecewise, shard, mixed, mrope, vision)
    if cuda_graphs:  # every rank runs them (their collectives pair up)
        steps = warm_up_steps(
            spec.block_size, blocks, config.max_num_batched_tokens, max_model_len, config.max_num_seqs
        )
        runner.warm_up = lambda: _warm_up(runner, steps, shard, config.dtype)
        if not lazy:
            runner.idle_work()  # the graphs are captured: the warm-up steps alone
            lap("warm_up_steps")
    checkpoint("ready")
    return Rank(
        runner,
        blocks,
        max_model_len,
        graphs.buckets if graphs is not None else None,
        piecewise.buckets if piecewise is not None else None,
        mixed.buckets if mixed is not None else None,
        reducer,
        report,
        MappingProxyType(laps),
    )
