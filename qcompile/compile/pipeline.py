"""The compiler, stage by stage (ARCHITECTURE.md's table):

    load      checkpoint dir -> ModelSpec + lazy tensors, every shard header checked, config.json's
              sizes held to the tensors (sizes.py), a tokenizer present (or --no-tokenizer); a
              pre-quantized checkpoint's stored linears checked, the recipe's quantization its own
              (recipe/prequantized.py): they are copied, not quantized again
    plan      spec + recipe  -> graph (built unfused, then the recipe's passes) + tensor plan
    kv layout recipe         -> the KV-cache contract
    quantize / fuse / permute / shard (streamed, row chunk by row chunk)  -> weights/*.safetensors
    graph     graph + where each weight landed -> graph.onnx (weights as external data)
    write     config.json, tokenizer files, manifest.json with every hash; renamed into place

At tp > 1 (recipe `tp`, `compile --tp N`) the graph is every rank's, the weights each rank's slices
in weights/rank{r}/, and each rank gets its own graph.rank{r}.onnx pointing into its files.

Stages talk through plain data. Nothing appears at the output path until every stage is done.
"""

from __future__ import annotations

import errno
import json
import shutil
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from qruntime.target import DEFAULT_TARGET, get_target

from qcompile.compile.awq_scales import AwqScales
from qcompile.compile.calibrate import CalibrationError, kv_scales
from qcompile.compile.draft_layers import DraftLayers, parse_draft_layers, search_draft_layers, search_runs
from qcompile.compile.kvcache import kv_cache_spec
from qcompile.compile.manifest import file_table, tensor_table, toolchain, write_manifest
from qcompile.compile.plan import TensorPlan, make_plan
from qcompile.compile.vision_entry import VISION_GRAPH_FILE, vision_entry
from qcompile.compile.writer import SPARSE_DIGEST, write_sparse_weights, write_weights
from qcompile.errors import ArtifactError, PlanError
from qcompile.graph.build import build_graph
from qcompile.graph.ir import Graph
from qcompile.graph.onnx_export import TensorLocation, write_onnx
from qcompile.graph.passes import apply_passes
from qcompile.graph.vision_tower import build_vision_graph
from qcompile.io.atomic import atomic_output_dir, check_free_space
from qcompile.io.safetensors_stream import read_header
from qcompile.progress import progress_bar
from qcompile.quant import get_scheme
from qcompile.recipe.prequantized import recipe_for_stored
from qcompile.recipe.quant_config import quantization_config
from qcompile.recipe.schema import Recipe, RecipeError
from qcompile.source.checkpoint import Checkpoint, fingerprint

GRAPH_FILE = "graph.onnx"


def graph_files(tp: int) -> list[str]:
    """The graph file of each rank: graph.onnx at tp=1, graph.rank{r}.onnx at tp > 1."""
    return [GRAPH_FILE] if tp == 1 else [f"graph.rank{rank}.onnx" for rank in range(tp)]


@dataclass(frozen=True)
class Prepared:
    """Everything decided before the first byte is written."""

    checkpoint: Checkpoint
    recipe: Recipe
    graph: Graph
    plan: TensorPlan
    kv_cache: dict[str, Any]
    tokenizer: bool = True  # false: compiled with --no-tokenizer, no tokenizer files in the artifact
    speculative: DraftLayers | None = None  # --draft-layers: the self-speculative draft's skipped layers
    awq: AwqScales | None = None  # quantization.method awq: the scales applied to the source while writing
    vision: Graph | None = None  # Qwen3-VL: the vision tower's graph (vision.onnx), its weights in the plan


def prepare(
    checkpoint_path: str | Path,
    recipe: Recipe,
    calib: str | Path | None = None,
    *,
    calibrate: bool = True,
    progress: bool = False,
    tokenizer: bool = True,
    draft_layers: str | None = None,
) -> Prepared:
    """load + plan + kv layout: validates everything, reads only headers.

    A pre-quantized checkpoint replaces `recipe`'s quantization with its own (its scheme must be the
    recipe's: qcompile.recipe.prequantized), which `Prepared.recipe` holds.

    The checkpoint must hold a tokenizer qruntime can load (tokenizer.json), unless `tokenizer` is
    false (`compile --no-tokenizer`): then none is copied and the manifest says `"tokenizer": false`.

    A recipe with kv_cache.calibrate needs `calib` (a text file): its fp8 KV scales are calibrated
    on it here, layer by layer through the source model (calibrate=False: only check the file is
    there, for a dry run; the plan does not depend on the scales' values).

    draft_layers ("auto" or "3,5,7"): the decoder layers a self-speculative draft skips, searched on
    `calib` (auto) or given, recorded in the manifest (compile/draft_layers.py).

    A recipe with quantization.method awq (`w4a16-awq`) needs `calib` too: its AWQ scales are
    searched on it once the plan is checked, layer by layer (compile/awq_search.py)."""
    checkpoint = Checkpoint.open(checkpoint_path)
    if recipe.quantization.method == "awq":
        from qcompile.compile.awq_search import check_awq

        check_awq(checkpoint, recipe)  # before a pre-quantized checkpoint's own recipe replaces this one
    recipe = recipe_for_stored(recipe, checkpoint)  # a pre-quantized checkpoint's scheme and ignore list
    if tokenizer:
        checkpoint.require_tokenizer()
    scales = None
    if recipe.kv_cache.calibrate:
        if calib is None:
            raise RecipeError(
                f"recipe {recipe.name!r} calibrates its fp8 KV cache: give the calibration text (--calib FILE)"
            )
        if not Path(calib).is_file():
            raise CalibrationError(f"{calib}: calibration text not found")
        if calibrate:
            with progress_bar(checkpoint.spec.num_hidden_layers, "calibrate kv", progress, unit="layer") as bar:
                scales = kv_scales(checkpoint, Path(calib), progress=lambda _: bar.update(1))
    elif calib is not None and draft_layers != "auto" and not recipe.needs_calib:
        raise RecipeError(
            f"--calib {calib}: recipe {recipe.name!r} has no calibrated KV cache (kv_cache.calibrate) nor AWQ "
            "(quantization.method awq), and --draft-layers auto is not asked for"
        )
    if recipe.quantization.method == "awq":
        if calib is None:
            raise RecipeError(f"recipe {recipe.name!r} searches AWQ scales on calibration text: give it (--calib FILE)")
        if not Path(calib).is_file():
            raise CalibrationError(f"{calib}: calibration text not found")
    speculative = _draft_layers(checkpoint, recipe, draft_layers, calib, calibrate, progress)
    try:
        graph = apply_passes(build_graph(checkpoint.spec, recipe, scales), recipe.passes)
    except PlanError as exc:
        if checkpoint.quantization is None:
            raise
        raise PlanError(
            f"{exc} ({checkpoint.path} is pre-quantized: which linears are quantized is fixed by its stored "
            "tensors, so leave the pass out: --set passes=[…])"
        ) from exc
    vision = _vision_graph(checkpoint, recipe)
    graph, vision = _for_target(checkpoint, recipe, graph), vision and _for_target(checkpoint, recipe, vision)
    weights = {**graph.weights, **(vision.weights if vision is not None else {})}
    plan = make_plan(checkpoint, weights, recipe.max_shard_mb << 20, recipe.tp)
    kv = kv_cache_spec(checkpoint.spec, recipe, scales)
    awq = None
    if recipe.quantization.method == "awq" and calibrate:  # after the plan: its errors come before the search
        from qcompile.compile.awq_search import search_awq

        with progress_bar(checkpoint.spec.num_hidden_layers, "awq search", progress, unit="layer") as bar:
            awq = search_awq(checkpoint, recipe, Path(calib), progress=lambda: bar.update(1))
    return Prepared(checkpoint, recipe, graph, plan, kv, tokenizer, speculative, awq, vision)


def _for_target(checkpoint: Checkpoint, recipe: Recipe, graph: Graph) -> Graph:
    """The graph's weight jobs in the target's FP8 format (qruntime.target): e4m3fn as they are, for
    amd-gfx942 e4m3fnuz (the same codes, scales doubled: the dequantized weights are the same). An
    FP8 KV cache keeps its e4m3fn scales: the runtime stores e4m3fnuz codes and reads them at twice
    those (qruntime.kv_cache.KVCache). What that target cannot take yet is refused here, before any
    byte is written."""
    target = get_target(recipe.target)
    if target.fp8 == "float8_e4m3fn":
        return graph
    if checkpoint.quantization is not None:
        raise PlanError(
            f"--target {target.name}: {checkpoint.path} is pre-quantized ({checkpoint.quantization.scheme}); "
            "its stored weights are copied as they are, which this target does not take yet: compile it for "
            f"{DEFAULT_TARGET}, or compile a bf16 checkpoint for {target.name}"
        )
    weights = {name: replace(job, fp8=target.fp8) for name, job in graph.weights.items()}
    return replace(graph, weights=weights)


def _vision_graph(checkpoint: Checkpoint, recipe: Recipe) -> Graph | None:
    """A Qwen3-VL checkpoint's vision graph (None for Qwen3); its manifest entry is checked here too, so
    a bad preprocessor_config.json stops the compile before any weight is written."""
    if checkpoint.spec.vision is None:
        return None
    vision_entry(checkpoint.spec, checkpoint.path, recipe.vision.scheme)
    return build_vision_graph(checkpoint.spec, recipe)


def _draft_layers(
    checkpoint: Checkpoint,
    recipe: Recipe,
    text: str | None,
    calib: str | Path | None,
    search: bool,
    progress: bool,
) -> DraftLayers | None:
    """prepare's draft_layers: given, searched on calib (search=False: a dry run checks the file only)."""
    if text is None:
        return None
    if recipe.tp > 1:
        raise RecipeError(f"--draft-layers: speculative decoding runs at tp = 1 only (the recipe has tp = {recipe.tp})")
    layers = parse_draft_layers(text, checkpoint.spec.num_hidden_layers)
    if layers != "auto":
        return DraftLayers(layers)
    if calib is None:
        raise RecipeError("--draft-layers auto searches on calibration text: give it (--calib FILE)")
    if not Path(calib).is_file():
        raise CalibrationError(f"{calib}: calibration text not found")
    if not search:
        return None
    total = search_runs(checkpoint.spec.num_hidden_layers)
    with progress_bar(total, "draft layers", progress, unit="layer") as bar:
        return search_draft_layers(checkpoint, Path(calib), progress=lambda: bar.update(1))


def compile_checkpoint(
    prepared: Prepared,
    output: str | Path,
    force: bool = False,
    workers: int = 2,
    progress: bool = True,
    source_label: str | None = None,
    synthetic: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the artifact for `prepared` at `output`; returns its manifest.

    `synthetic` (qcompile.synth.artifact): write every weight file sparse (its header, then a hole)
    instead of quantizing the source, and record the dict as the manifest's `synthetic` entry; the
    runtime then makes random weights on the device at load."""
    checkpoint, plan = prepared.checkpoint, prepared.plan
    if synthetic is None:
        check_free_space(Path(output).absolute().parent, plan.output_bytes, "the artifact")
    with atomic_output_dir(output, force) as tmp:
        if synthetic is not None:
            source_hash, shard_digests = None, write_sparse_weights(tmp, plan)
        else:
            source_hash = _BackgroundHash(checkpoint, progress)
            label = "transcode+write" if checkpoint.quantization is not None else "quantize+write"
            with progress_bar(plan.source_bytes, label, progress) as bar:
                try:
                    shard_digests = write_weights(
                        tmp, checkpoint, plan, workers=workers, progress=bar.update, transform=prepared.awq
                    )
                except OSError as exc:
                    if exc.errno == errno.ENOSPC:
                        raise ArtifactError(f"{output}: the disk filled up while writing weights ({exc})") from exc
                    raise
        graphs = graph_files(plan.tp)
        for rank, file in enumerate(graphs):
            ranked = {} if plan.tp == 1 else {"rank": str(rank)}
            write_onnx(prepared.graph, _locations(tmp, plan, rank), tmp / file, metadata=ranked)
        if prepared.vision is not None:
            write_onnx(prepared.vision, _locations(tmp, plan), tmp / VISION_GRAPH_FILE)
        _write_config(tmp, prepared)
        for path in checkpoint.side_files(tokenizer=prepared.tokenizer):
            shutil.copyfile(path, tmp / path.name)
        manifest = {
            "toolchain": toolchain(),
            "source": {
                "path": source_label if source_label is not None else str(checkpoint.path),
                "fingerprint": source_hash.result() if source_hash is not None else SPARSE_DIGEST,
                "architecture": checkpoint.spec.architecture,
                **checkpoint.license(),  # from the source's README.md front matter, when it names one
                # pre-quantized input: how it was stored (its linears copied into the artifact as they are)
                **({"quantization": checkpoint.quantization.to_dict()} if checkpoint.quantization else {}),
            },
            "spec": checkpoint.spec.to_dict(),
            "recipe": prepared.recipe.to_dict(),
            "passes": list(prepared.graph.applied_passes),
            "kv_cache": prepared.kv_cache,
            "graph": {
                **({"file": GRAPH_FILE} if plan.tp == 1 else {"files": graphs}),
                "opset": 23,
                "domains": {"qcompile": 1},
            },
            "tp": prepared.recipe.tp,
            "target": prepared.recipe.target,  # qruntime.target: the GPU family, its FP8 format
            "tokenizer": prepared.tokenizer,  # false: no tokenizer files; prompts must be token ids
            "tensors": tensor_table(plan),
            "files": file_table(tmp, shard_digests, workers),
        }
        if synthetic is not None:
            manifest["synthetic"] = synthetic
        if prepared.speculative is not None:
            manifest["speculative"] = prepared.speculative.to_dict()
        if prepared.awq is not None:
            manifest["awq"] = prepared.awq.to_dict()
        if prepared.vision is not None:
            manifest["vision"] = vision_entry(checkpoint.spec, checkpoint.path, prepared.recipe.vision.scheme)
        write_manifest(tmp, manifest)
    return manifest


def _locations(root: Path, plan: TensorPlan, rank: int = 0) -> dict[str, TensorLocation]:
    """Where each tensor's bytes (rank `rank`'s) are, read back from the headers actually written."""
    locations: dict[str, TensorLocation] = {}
    for shard in plan.shards:
        if shard.rank != rank:
            continue
        entries, _ = read_header(root / shard.file)
        for name, entry in entries.items():
            locations[name] = TensorLocation(shard.file, entry.begin, entry.nbytes, entry.torch_dtype, entry.shape)
    return locations


def _write_config(root: Path, prepared: Prepared) -> None:
    config = dict(prepared.checkpoint.config)
    qconfig = quantization_config(get_scheme(prepared.recipe.quantization.scheme), prepared.recipe)
    config.pop("quantization_config", None)
    lm_head = prepared.graph.weights.get("lm_head")
    if lm_head is not None and lm_head.role == "lm_head" and config.get("tie_word_embeddings"):
        # an FP8 lm_head made from the tied embedding is its own tensor now; loaders that honour
        # the flag (vLLM skips lm_head.* when tied) would otherwise drop it, as llm-compressor also unties
        config["tie_word_embeddings"] = False
    if qconfig is not None:
        config["quantization_config"] = qconfig
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


class _BackgroundHash:
    """The source fingerprint, hashed on a thread while the weights are written."""

    def __init__(self, checkpoint: Checkpoint, progress: bool) -> None:
        self._result: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(checkpoint,), daemon=True, name="qcompile-fingerprint")
        self._thread.start()

    def _run(self, checkpoint: Checkpoint) -> None:
        try:
            self._result = fingerprint(checkpoint)
        except BaseException as exc:  # reported to the caller by result()
            self._error = exc

    def result(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result
