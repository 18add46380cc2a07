"""`load(path)`: an artifact directory -> a ready Engine (manifest checked, plan bound, cache sized);
at tp > 1 with a worker process per rank beyond the first (engine/workers.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from qruntime.artifact import (
    ArtifactFormatError,
    artifact_path,
    file_problem,
    optional_artifact_path,
    read_manifest,
    require,
    verify_files,
)
from qruntime.early_prebuild import EarlyPrebuild
from qruntime.engine.engine import Engine
from qruntime.engine.multimodal import VisionModel
from qruntime.engine.prefix_cache import kv_salt
from qruntime.engine.scheduler import Scheduler, SchedulerConfig
from qruntime.engine.speculative.config import SpeculativeConfig
from qruntime.engine.speculative.draft import ProposerContext
from qruntime.engine.speculative.speculator import Speculator
from qruntime.engine.workers import Workers
from qruntime.hub import is_hub_url, pull
from qruntime.kv_cache import KVCacheSpec
from qruntime.load_options import resolve_backend, resolve_device, resolve_dtype
from qruntime.ops.base import KVOp
from qruntime.plan import Plan
from qruntime.rank import GRAPH_CAPTURE, Rank, RankConfig, build_rank
from qruntime.synthetic import is_synthetic
from qruntime.target import DEFAULT_TARGET, check_device, device_target, get_target
from qruntime.tokenizer import (
    CHAT_TEMPLATE_FILE,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    TokenIdsOnly,
    Tokenizer,
    TokenizerError,
)
from qruntime.vision.positions import VisionTokenConfig
from qruntime.vision.preprocess import VisionPreprocessConfig
from qruntime.vision.video import VideoPreprocessConfig

MAX_CPU_TP = 8  # ranks a CPU (gloo) engine may spawn: one process each
# what Tokenizer.from_dir reads when present: each must be a file the manifest lists, reached by no link
TOKENIZER_READS = (
    TOKENIZER_JSON,
    TOKENIZER_CONFIG,
    "special_tokens_map.json",
    "generation_config.json",
    "config.json",
    CHAT_TEMPLATE_FILE,
)


def _check_files(root: Path, manifest: dict, verify: bool) -> None:
    """Every listed file must be a regular file of the artifact (no link) with its size (cheap,
    always); with verify, its sha256 too."""
    if verify:
        problems = [str(p) for p in verify_files(root, manifest)]
    else:
        problems = [
            str(p) for rel, info in manifest["files"].items() if (p := file_problem(root, rel, info, hashes=False))
        ]
    if problems:
        raise ArtifactFormatError(f"{root}: the artifact does not match its manifest:\n  " + "\n  ".join(problems))


def resolve_pdl(pdl: bool | None, device: torch.device, backend: str) -> bool:
    """None -> whether the triton backend's GPU has programmatic dependent launch; True is checked."""
    from qruntime.kernels import pdl_supported

    supported = backend == "triton" and pdl_supported(device)
    if pdl and not supported:
        raise ValueError(
            f"pdl=True needs the triton backend on an NVIDIA GPU of compute capability 9.0 or later "
            f"(backend {backend!r} on {device})"
        )
    return supported if pdl is None else bool(pdl)


def _check_tp(tp: int | None, manifest: dict, root: Path) -> int:
    """The artifact's tp; a different `tp` asked for is a ValueError naming both."""
    sharded = manifest.get("tp", 1)  # a power of two up to manifest_schema.MAX_TP, checked on read
    if tp is not None and tp != sharded:
        raise ValueError(
            f"tp={tp} was asked for but {root} is sharded for tp={sharded}: load it with tp={sharded} "
            f"(or leave tp out), or compile the checkpoint again with `qcompile compile --tp {tp}`"
        )
    return sharded


def _graph_files(manifest: dict, tp: int, root: Path) -> tuple[str, ...]:
    """Each rank's graph file: graph.file at tp=1, graph.files (graph.rank{r}.onnx) at tp > 1."""
    graph = manifest.get("graph", {})
    files = [graph.get("file", "graph.onnx")] if tp == 1 else graph.get("files")
    if not isinstance(files, list) or len(files) != tp:
        raise ArtifactFormatError(
            f"{root / 'manifest.json'}: a tp={tp} artifact lists one graph file per rank in graph.files"
        )
    for name in files:
        artifact_path(root, name, listed=manifest["files"])
    return tuple(files)


def _check_tp_device(device: torch.device, tp: int) -> None:
    """Before anything is spawned: rank r on cuda:r needs tp GPUs; a CPU engine at most MAX_CPU_TP ranks."""
    if tp > MAX_CPU_TP and device.type == "cpu":
        raise ValueError(
            f"tp={tp} on CPU would start {tp - 1} worker processes; the CPU engine runs at most tp={MAX_CPU_TP}"
        )
    if tp > 1 and device.type == "cuda":
        if device.index not in (None, 0):
            raise ValueError(
                f"tp={tp} runs rank r on cuda:r; device {device} cannot be rank 0 (choose GPUs with "
                "CUDA_VISIBLE_DEVICES)"
            )
        if torch.cuda.device_count() < tp:
            raise ValueError(f"tp={tp} needs {tp} GPUs; this machine has {torch.cuda.device_count()}")


def kv_identity(kv_cache: dict, dtype: torch.dtype, plan: Plan) -> dict:
    """What decides the bytes a KV block holds for given tokens, the prefix cache's salt (kv_salt): the
    manifest's kv_cache (dtype, layout, block size, head shape, per-layer scales), the compute dtype
    (an unquantized cache stores it), and the layer, layout and k/v scales of every op of the graph
    that writes or reads the cache (the scales the kernels are given)."""
    kv_ops = [{k: node.op.a[k] for k in KVOp.attrs} for node in plan.nodes if isinstance(node.op, KVOp)]
    return {"kv_cache": kv_cache, "dtype": str(dtype).removeprefix("torch."), "kv_ops": kv_ops}


class LoadClock:
    """Seconds since load() began at the marks of a load: "build" (the ranks' build begins: manifest,
    tokenizer and checks before it), build_rank's checkpoints "loaded" (weights bound), "planned"
    (the plan and its folds), "kernels" (the recorded kernels built: what the load waited for them
    beyond the weights) and "ready" (KV cache allocated, CUDA graphs captured, the kernels they
    launch built), and "done"."""

    def __init__(self) -> None:
        self.start, self.at = time.perf_counter(), {}

    def mark(self, tag: str) -> None:
        self.at[tag] = time.perf_counter() - self.start

    def phases(self) -> dict[str, float]:
        """Seconds each phase took (those whose marks were reached), and the total."""
        names = {
            "build": "setup",
            "loaded": "weights",
            "planned": "plan",
            "kernels": "kernels",
            "ready": "cache_and_graphs",
            "done": "rest",
        }
        out, last = {}, 0.0
        for tag, name in names.items():
            if tag in self.at:
                out[name], last = round(self.at[tag] - last, 3), self.at[tag]
        out["total"] = round(last, 3)
        return out


def _build(config: RankConfig, clock: LoadClock, early: EarlyPrebuild | None) -> tuple[Rank, Workers | None]:
    """Rank 0's runner; at tp > 1 also the workers of the other ranks, built alongside it (the
    checkpoints marked on `clock` when every rank has passed them)."""
    clock.mark("build")
    if config.tp == 1:
        return build_rank(config, checkpoint=clock.mark, early=early), None
    if early is not None:  # start_early starts none for a sharded artifact
        early.cancel()
    workers = Workers(config)

    def checkpoint(tag: str) -> None:
        workers.checkpoint(tag)
        clock.mark(tag)

    try:
        built = build_rank(config, 0, workers.store, checkpoint)
        if built.all_reduce is not None:  # a worker that dies must not leave rank 0's kernels waiting for it
            workers.on_death(built.all_reduce.abort)
        return built, workers
    except BaseException as exc:
        error = workers.abandon(exc)
        if error is exc:
            raise
        raise error from exc


def load(
    path: str | Path,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    tp: int | None = None,
    verify: bool = False,
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    num_kv_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    backend: str = "auto",
    cuda_graphs: bool | None = None,
    prefix_cache: bool = True,
    custom_all_reduce: bool = True,
    sharded_sampling: bool = True,
    pdl: bool | None = None,
    speculative: str | SpeculativeConfig | None = None,
    small_step_graphs: bool | None = None,
    prebuild_kernels: bool = True,
    graph_capture: str = "first-use",
    started_prebuild: EarlyPrebuild | None = None,
    manifest: dict[str, Any] | None = None,
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
    cuda_graphs: replay decode steps from captured graphs, one per batch size, and the other steps
    (prefill, mixed) from whole-step graphs, one per token count up to max_num_batched_tokens
    (engine/mixed_graphs.py), or, for fresh long prompts that cuDNN's attention serves better, from
    piecewise graphs with attention run eagerly between the pieces (engine/piecewise_graphs.py;
    neither for a recipe with per-tensor activation scales, whose steps with prefill then run
    eagerly). Default: on with the triton backend when every op of the graph can be captured.
    prefix_cache: automatic prefix caching: full KV blocks are kept after their request ends, named by
    a hash chain of their tokens (salted with the artifact's KV encoding), and a request whose prompt
    starts with cached blocks reuses their KV instead of computing it (engine.prefix_cache_stats
    counts the tokens looked up and found). Greedy outputs are the same either way (in bf16, up to
    near-ties that any change of chunking flips too).

    tp: the tensor-parallel degree; default, and the only value accepted, the artifact's (`qcompile
    compile --tp N`). At tp=N > 1 this process is rank 0: it runs the scheduler, the sampler and the
    tokenizer, and sends every step to N-1 worker processes it spawns (one per other rank, each
    holding its shard of the weights and of the KV cache); the graphs' all-reduces run over
    torch.distributed, NCCL on CUDA (rank r on cuda:r; NCCL_NVLS_ENABLE=0 is set, NVLink multicast
    stays off) or gloo on CPU. Every size above applies per rank; the KV cache gets the fewest blocks
    any rank can hold. Call `engine.close()` (or use `with qruntime.load(...) as engine:`) to stop
    the workers; a finaliser does it when the engine is collected or the interpreter exits. A worker
    that fails (at load or in a step) raises qruntime.WorkerError naming its rank, with its
    traceback, and closes the engine. custom_all_reduce (tp > 1, triton backend): messages up to the
    limit `qcompile tune` stored (512 KiB without one: a decode step's) are summed by one kernel that
    reads every rank's copy through CUDA IPC peer memory, fused with the AddRMSNorm[Quant] that
    follows (qruntime/comm), larger ones by the two-shot kernel where tune found it faster; the rest,
    and all of them when False or when some pair of GPUs has no peer access, go through NCCL.
    sharded_sampling (tp > 1, an artifact whose lm_head is split by vocabulary): each rank keeps its
    columns of the logits and the ranks choose the tokens together, exchanging a few numbers per row
    (engine/sharded_sampler.py; the same tokens as from gathered rows); a step with top_p, penalties,
    structured output or logprobs gathers the rows instead, as every step does when False. The
    pdl (triton backend): launch the kernels with programmatic dependent launch, so that each starts
    while the one before it finishes (kernels/pdl.py); default on where the GPU has it (Hopper and
    later), True where it does not is a ValueError.
    speculative: speculative decoding (engine/speculative/), a SpeculativeConfig or its text form
    ("prompt-lookup", "prompt-lookup:num_tokens=6,prompt_lookup_max=3"): decoding requests draft
    tokens that one step verifies, keeping the model's output distribution (greedy outputs as
    without it); engine.speculative_stats counts the acceptance. tp = 1 only.
    small_step_graphs (with cuda_graphs): whole-step graphs for steps of 8, 16, 32 and 64 tokens too,
    which otherwise pad to 128 (engine/piecewise_graphs.py VERIFY_BUCKETS): default on when
    speculative (its verification steps hold k + 1 tokens a request), and a draft model's engine has
    them (its steps compute what a verification kept).
    The tp > 1
    workers are spawned: a script that loads at tp > 1 must guard its entry point with
    `if __name__ == "__main__":`. One tp engine per process at a time,
    in a process without a torch.distributed default group of its own.
    prebuild_kernels (triton backend on an NVIDIA GPU): when the artifact has a kernel build list for
    this GPU model and Triton (kernel_builds/<device>.json, written by `qcompile tune`), build every
    kernel in it in parallel while the weights load, so the first launches find them in Triton's
    cache (qruntime.kernel_prebuild; the list holds choices of our own kernels, never code: nothing
    to trust). description["kernel_prebuild"] reports it. started_prebuild: that build, already
    started for this call by qruntime.load (qruntime.early_prebuild.start_early, right after torch's
    import, before this module's); taken over when it fits what the load decides, else cancelled
    (the caller cancels it when the load fails before it is taken over). manifest: the local
    artifact's read_manifest, as qruntime.load read it once for its read-ahead and early build (None:
    read here).
    graph_capture (with cuda_graphs): "first-use" captures each graph (a decode batch size, a token
    count) at the first step that needs it, and an idle server (or a caller of engine.idle_work)
    captures the rest, largest first, then runs the warm-up steps; the load returns as soon as the
    KV cache is allocated. "load" captures all of them and runs the warm-up steps before returning,
    so that no step pays a capture (benchmarks of steady speed use it). A speculating engine's draft
    follows the same choice: with "first-use" its graphs (a layer-skip draft's decode graphs, a
    draft model's every graph) are the idle work's once the target's are done.
    The engine's description["load_seconds"] says where the load's time went (LoadClock.phases).
    """
    if graph_capture not in GRAPH_CAPTURE:
        raise ValueError(f"graph_capture must be one of {', '.join(GRAPH_CAPTURE)}, got {graph_capture!r}")
    clock = LoadClock()
    if isinstance(speculative, str):
        speculative = SpeculativeConfig.parse(speculative)
    if is_hub_url(path):
        root = pull(path)
        verify = False  # pull has checked every file's sha256
    else:
        root = Path(path)
    if manifest is None or is_hub_url(path):
        manifest = read_manifest(root)
    require(manifest, root, "kv_cache", "spec.vocab_size", "spec.max_position_embeddings")
    tp = _check_tp(tp, manifest, root)
    if speculative is not None and tp > 1:
        raise ValueError(f"speculative decoding runs at tp = 1 only (this artifact is tp = {tp})")
    graph_files = _graph_files(manifest, tp, root)
    device = resolve_device(device)
    _check_tp_device(device, tp)
    compute_dtype = resolve_dtype(dtype, manifest)
    backend = resolve_backend(backend, device, compute_dtype)
    _check_target(manifest, root, device)
    pdl = resolve_pdl(pdl, device, backend)
    _check_files(root, manifest, verify)
    try:
        kv_spec = KVCacheSpec.from_manifest(manifest["kv_cache"])
    except ValueError as exc:
        raise ArtifactFormatError(f"{root / 'manifest.json'}: {exc}") from exc
    vocab_size, context = manifest["spec"]["vocab_size"], manifest["spec"]["max_position_embeddings"]
    if max_model_len is not None and not 1 < max_model_len <= context:
        raise ValueError(f"max_model_len {max_model_len} must be in 2..{context} (the model's context)")
    for name in TOKENIZER_READS:  # Tokenizer.from_dir reads them by name: confine them first
        optional_artifact_path(root, name, listed=manifest["files"])
    has_tokenizer = manifest.get("tokenizer", True)  # false: compiled with --no-tokenizer (a bool: the schema)
    try:
        tokenizer = Tokenizer.from_dir(root) if has_tokenizer else TokenIdsOnly.from_dir(root)
    except TokenizerError as exc:
        raise ArtifactFormatError(str(exc)) from exc

    config = RankConfig(
        root=root,
        graph_files=graph_files,
        listed=frozenset(manifest["files"]),
        kv_spec=kv_spec,
        device=device,
        dtype=compute_dtype,
        backend=backend,
        context=context,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_kv_blocks=num_kv_blocks,
        kv_cache_memory=kv_cache_memory,
        cuda_graphs=cuda_graphs,
        synthetic=is_synthetic(manifest),
        custom_all_reduce=custom_all_reduce,
        sharded_sampling=sharded_sampling,
        pdl=pdl,
        target=manifest.get("target", DEFAULT_TARGET),
        small_step_graphs=speculative is not None if small_step_graphs is None else small_step_graphs,
        prebuild_kernels=prebuild_kernels,
        graph_capture=graph_capture,
    )
    if "vision" in manifest and speculative is not None:
        raise ValueError(f"{root}: a Qwen3-VL artifact runs without speculative decoding for now")
    speculator = None
    if speculative is not None:  # first: a draft model then loads before the target takes the GPU's memory
        draft_layers = manifest.get("speculative", {}).get("draft_layers")
        speculator = _speculator(speculative, config, vocab_size, tokenizer, draft_layers)
    try:
        built, workers = _build(config, clock, started_prebuild)
    except BaseException:
        if speculator is not None:
            speculator.close()
        raise
    try:
        vision = _vision_model(root, manifest, config) if "vision" in manifest else None
    except BaseException:
        if workers is not None:
            workers.close()
        raise
    try:
        scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=built.num_blocks,
                block_size=kv_spec.block_size,
                max_model_len=built.max_model_len,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                prefix_caching=prefix_cache,
                kv_salt=kv_salt(kv_identity(manifest["kv_cache"], compute_dtype, built.runner.plan)),
            )
        )
    except BaseException:
        if workers is not None:
            workers.close()
        raise
    description: dict[str, Any] = {
        "artifact": str(path) if is_hub_url(path) else str(root),
        "device": str(device),
        "dtype": str(compute_dtype).removeprefix("torch."),
        "kv_cache": f"{kv_spec.layout.name} {kv_spec.kv_dtype}, {built.num_blocks} blocks x {kv_spec.block_size}"
        f", prefix cache {'on' if prefix_cache else 'off'}",
        "prefix_cache": prefix_cache,
        "max_model_len": built.max_model_len,
    }
    if tp > 1:
        description["tp"] = tp
        if built.all_reduce is not None:
            description["all_reduce"] = built.all_reduce.describe()
        if built.runner.vocab_shard is not None:
            description["sampling"] = "from the ranks' vocabulary shards (rows gathered for top_p, penalties, logprobs)"
    if built.graph_buckets is not None:
        description["cuda_graphs"] = list(built.graph_buckets)
        description["graph_capture"] = graph_capture
    if built.piecewise_buckets is not None:
        description["piecewise_graphs"] = list(built.piecewise_buckets)
    if built.mixed_buckets is not None:
        description["mixed_graphs"] = list(built.mixed_buckets)
    description["backend"] = backend
    if speculative is not None:
        description["speculative"] = f"{speculative.method}, up to {speculative.num_tokens} draft tokens"
    if backend == "triton":
        description["pdl"] = pdl
    if built.prebuild is not None:
        description["kernel_prebuild"] = built.prebuild.summary()
    if built.graph_seconds:
        description["graph_seconds"] = dict(built.graph_seconds)
    if config.synthetic:
        description["weights"] = "SYNTHETIC: random values made on the device (qcompile synth --artifact)"
    engine = Engine(
        built.runner,
        scheduler,
        tokenizer,
        vocab_size=vocab_size,
        max_model_len=built.max_model_len,
        description=description,
        workers=workers,
        speculator=speculator,
        vision=vision,
    )
    try:
        while graph_capture == "load" and speculator is not None and speculator.idle_work():
            pass  # the draft's graphs too (a layer-skip draft's exist once the engine attached it)
    except BaseException:
        engine.close()
        raise
    clock.mark("done")
    engine.description["load_seconds"] = clock.phases()
    return engine


def _check_target(manifest: dict, root: Path, device: torch.device) -> None:
    """The artifact's compile target (qruntime.target; none: nvidia-sm90) against the device: a GPU of
    another family is refused naming both. Both backends run every target: the reference ops
    dequantize either FP8 format; the Triton ops take the target's (RankConfig.target -> OpEnv.fp8)."""
    target = get_target(manifest.get("target", DEFAULT_TARGET))  # one of TARGETS: the schema checked it
    check_device(target, device_target(device), str(root))


def _vision_model(root: Path, manifest: dict, config: RankConfig) -> VisionModel:
    """A Qwen3-VL artifact's vision side (manifest["vision"]): the encoder bound to its graph and
    weights, the image settings; every config checked (errors name the manifest field). Built in
    this process only: at tp > 1 rank 0 alone runs the encoder and holds the tower's weights (a tp
    artifact writes them once, into weights/rank0/vision-*), and broadcasts each step's image rows'
    embeddings to the other ranks (engine/vision_share.py)."""
    from qruntime.vision.encoder import load_vision_encoder

    entry = manifest["vision"]
    try:
        tokens = VisionTokenConfig(**entry["tokens"])
        preprocess = VisionPreprocessConfig.from_dict(entry["preprocessor"])
        video = entry.get("video_preprocessor")  # absent: the defaults (VisionModel.video_config)
        video = None if video is None else VideoPreprocessConfig.from_dict(video)
    except (TypeError, ValueError) as exc:
        raise ArtifactFormatError(f"{root / 'manifest.json'}: vision: {exc}") from exc
    encoder = load_vision_encoder(
        root,
        entry,
        config.device,
        config.dtype,
        listed=config.listed,
        synthetic=config.synthetic,
        backend=config.backend,
        fp8=get_target(config.target).fp8_dtype,
    )
    width = (1 + entry["deepstack_layers"]) * manifest["spec"]["hidden_size"]
    return VisionModel(encoder, tokens, preprocess, width, video=video)


def _speculator(
    speculative: SpeculativeConfig,
    target: RankConfig,
    vocab_size: int,
    tokenizer: Any,
    draft_layers: list[int] | None,
) -> Speculator:
    """The engine's Speculator. A draft model is loaded here, on the target's device in its dtype and
    backend, with a KV pool of a tenth of the GPU's free memory (on CPU the default pool): requests
    it has no room for decode without drafts. Its vocabulary and EOS ids must be the target's."""

    def load_draft(path: str) -> Engine:
        memory = None
        if target.device.type == "cuda" and target.num_kv_blocks is None:
            memory = torch.cuda.mem_get_info(target.device)[0] // 10
        draft = load(
            path,
            target.device,
            target.dtype,
            backend=target.backend,
            cuda_graphs=target.cuda_graphs,
            prefix_cache=False,
            max_num_seqs=target.max_num_seqs,
            num_kv_blocks=target.num_kv_blocks,
            kv_cache_memory=memory,
            small_step_graphs=True,
            graph_capture=target.graph_capture,  # at first use: the target's idle work does the rest
        )
        if draft.vocab_size != vocab_size or tuple(draft.tokenizer.eos_token_ids) != tuple(tokenizer.eos_token_ids):
            draft.close()
            raise ValueError(
                f"draft model {path}: its vocabulary ({draft.vocab_size} ids, EOS {list(draft.tokenizer.eos_token_ids)}) "
                f"is not the target's ({vocab_size} ids, EOS {list(tokenizer.eos_token_ids)}): a draft must share the "
                "target's tokenizer"
            )
        return draft

    layers = tuple(draft_layers) if draft_layers is not None else None
    gate = speculative.gate if speculative.gate is not None else target.device.type == "cuda"
    return Speculator(speculative, ProposerContext(load_artifact=load_draft, draft_layers=layers), gate=gate)
