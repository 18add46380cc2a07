"""`w4a16-awq`: AWQ scales searched on calibration text, streaming the source one layer at a time.

For each decoder layer (source_layers.py: one layer's weights in memory, run in fp32) the
calibration hidden states go through the layer once, recording the inputs of the modules whose
output each group's loss is measured at (the smallest module holding the group, as llm-compressor's
AWQModifier takes it); then each group of the layer (awq_groups.py: AWQModifier's mappings for
Qwen3 and Qwen3-MoE) has its scales searched (qcompile.quant.awq) against the unquantized module's
output, and the layer's unchanged output becomes the next layer's input.

In a MoE layer the router and every expert's gate/up share one search, its loss the MoE block's
output (the router keeps its weights in the search, as in AWQModifier: it reads the unscaled input,
so the trial routes as the model does). Each expert's down_proj is searched on the tokens the router
sends to that expert (its input recomputed from the recorded MoE inputs and routes, as transformers'
experts compute it); an expert no calibration token reaches keeps scales of 1, and the manifest says
so. (AWQModifier's oneshot default, moe_calibrate_all_experts, runs every token through every expert
instead; the routed tokens are the ones each expert serves.)

Memory: one layer in fp32, the hidden states of the calibration tokens and, while a layer is
searched, the recorded inputs (model dtype); in a MoE layer also one trial copy of the experts'
gate/up and one expert's routed inputs at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from qcompile.compile import awq_groups
from qcompile.compile.awq_groups import Group, layer_groups
from qcompile.compile.awq_scales import AwqScales
from qcompile.compile.calibrate import CalibrationError, calibration_ids
from qcompile.compile.source_layers import SourceLayers
from qcompile.errors import QCompileError
from qcompile.quant.awq import AwqConfig, SearchResult, search_scales
from qcompile.recipe.schema import Recipe
from qcompile.source import model as hf
from qcompile.source.checkpoint import Checkpoint

MIN_TOKENS = 512  # fewer calibration tokens than this give scales fitted to noise


@dataclass(frozen=True)
class CalibrationSize:
    """How much calibration text a search uses: at most max_sequences sequences of seq_len tokens."""

    seq_len: int = 512
    max_sequences: int = 32
    batch: int = 4


def check_awq(checkpoint: Checkpoint, recipe: Recipe) -> None:
    """QCompileError unless AWQ can run on the checkpoint (unquantized) with the recipe's mappings
    (quantization.awq_mappings: those an llm-compressor recipe spelled out must be the ones
    AWQModifier takes for this architecture, which awq_groups.py holds)."""
    if checkpoint.quantization is not None:
        raise QCompileError(
            f"w4a16-awq searches scales on the unquantized model, and {checkpoint.path} is pre-quantized "
            f"({checkpoint.quantization.describe()}): compile its bf16 original"
        )
    given, fits = recipe.quantization.awq_mappings, "qwen3-moe" if checkpoint.spec.is_moe else "qwen3"
    if given not in ("auto", fits):
        raise QCompileError(
            f"recipe {recipe.name!r}: quantization.awq_mappings {given} (the AWQModifier mappings its recipe "
            f"spells out) are not AWQModifier's for {checkpoint.path}, a {checkpoint.spec.architecture} "
            f"checkpoint ({fits}): leave `mappings` out of the AWQModifier to take that architecture's"
        )


def search_awq(
    checkpoint: Checkpoint,
    recipe: Recipe,
    calib: Path,
    *,
    config: AwqConfig | None = None,
    size: CalibrationSize | None = None,
    progress: Callable[[], None] | None = None,
) -> AwqScales:
    """Every layer's AWQ scales on `calib` (a text file); progress() after each layer. config and
    size default to AwqConfig() and CalibrationSize()."""
    config, size = config or AwqConfig(), size or CalibrationSize()
    check_awq(checkpoint, recipe)
    source = SourceLayers(checkpoint, "w4a16-awq's scale search")
    ids = calibration_ids(checkpoint, calib, size.seq_len, size.max_sequences)
    if ids.numel() < MIN_TOKENS:
        raise CalibrationError(
            f"{calib}: {ids.numel()} calibration tokens in whole sequences of {size.seq_len}; AWQ needs at least "
            f"{MIN_TOKENS}: give more text"
        )
    hidden = source.embed(ids)  # [N, T, H], model dtype
    positions = torch.arange(ids.shape[1])[None]
    cos, sin = source.rotary(hidden[:1].float(), positions)
    columns: dict[str, torch.Tensor] = {}
    rows: dict[str, torch.Tensor] = {}
    searched: list[dict] = []
    with torch.inference_mode():
        for layer, module in source.layers(range(checkpoint.spec.num_hidden_layers)):
            module.float()
            groups = layer_groups(checkpoint.spec, layer)
            inputs = _run_layer(module, groups, hidden, (cos, sin), size.batch)
            chosen = awq_groups.routes(module.mlp, inputs["mlp"]) if checkpoint.spec.is_sparse_layer(layer) else []
            prefix = hf.layer_prefix(layer)
            for group in groups:
                names = [f"{prefix}.{b}.weight" for b in group.balance]
                quantized = [not recipe.ignores(n.removesuffix(".weight")) for n in names]
                if not any(quantized) or not _compatible(module, group):
                    continue
                if group.expert is None:
                    x = inputs[group.parent]
                else:
                    x = [awq_groups.routed_inputs(module.mlp, inputs["mlp"], chosen, group.expert, source.dtype)]
                    if x[0].shape[0] == 0:
                        searched.append({"layer": layer, "smooth": group.smooth, "tokens": 0, "skipped": True})
                        continue
                result = _search_group(module, group, x, (cos, sin), quantized, config, source.dtype)
                for name in names:
                    columns[name] = _combine(columns.get(name), result.scales, name)
                smooth = f"{prefix}.{group.smooth}.weight"
                rows[smooth] = _combine(rows.get(smooth), result.scales, smooth)
                entry = {"layer": layer, "smooth": group.smooth, **result.to_dict()}
                if group.expert is not None:
                    entry["tokens"] = int(x[0].shape[0])
                searched.append(entry)
                del x
            del inputs, chosen, module  # the layer's weights go before the next layer's are read
            if progress is not None:
                progress()
    if not torch.isfinite(hidden).all():
        raise CalibrationError("the source model's hidden states on the calibration text are not finite")
    digest = hashlib.sha256(Path(calib).read_bytes()).hexdigest()
    settings = {**asdict(config), **asdict(size)}
    return AwqScales(columns, rows, (Path(calib).name, digest, int(ids.numel())), tuple(searched), settings)


def _combine(old: torch.Tensor | None, new: torch.Tensor, name: str) -> torch.Tensor:
    """Two groups scaling the same tensor (v_proj's columns by q/k/v's, its rows by o_proj's) act on
    different axes; one group never scales a tensor twice on the same axis."""
    if old is not None:
        raise ValueError(f"{name}: an AWQ group scales it where another group already did, on the same axis")
    return new.float().contiguous()


def _compatible(module: Any, group: Group) -> bool:
    """False for v_proj -> o_proj under grouped-query attention (v_proj's rows are not o_proj's columns)."""
    if group.smooth.endswith("_proj"):
        out = awq_groups.weight(module, group.smooth).shape[0]
        return all(awq_groups.weight(module, b).shape[1] == out for b in group.balance)
    return True


def _run_layer(
    module: Any, groups: Sequence[Group], hidden: torch.Tensor, rope: tuple, batch: int
) -> dict[str, list[torch.Tensor]]:
    """Run the layer over `hidden` in batches, replacing it with the layer's output; returns the
    input of every group's parent module (the MoE block's for the experts'), batch by batch, in the
    model dtype."""
    inputs: dict[str, list[torch.Tensor]] = {g.parent: [] for g in groups if g.expert is None}

    def recorder(name: str) -> Callable:
        def hook(_module, args, kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            inputs[name].append(x.to(hidden.dtype))

        return hook

    handles = [
        module.get_submodule(name).register_forward_pre_hook(recorder(name), with_kwargs=True) for name in inputs
    ]
    try:
        for start in range(0, hidden.shape[0], batch):
            h = hidden[start : start + batch].float()
            out = module(h, attention_mask=None, position_ids=None, position_embeddings=rope)
            hidden[start : start + batch] = (out[0] if isinstance(out, tuple) else out).to(hidden.dtype)
    finally:
        for handle in handles:
            handle.remove()
    return inputs


def _parent_output(module: Any, group: Group, x: torch.Tensor, rope: tuple) -> torch.Tensor:
    if group.parent == "self_attn":
        return module.self_attn(hidden_states=x.float(), position_embeddings=rope, attention_mask=None)[0]
    if group.parent == "mlp":
        return module.mlp(x.float())
    return torch.nn.functional.linear(x.float(), awq_groups.weight(module, group.parent))  # a linear


def _search_group(
    module: Any,
    group: Group,
    inputs: Sequence[torch.Tensor],
    rope: tuple,
    quantized: Sequence[bool],
    config: AwqConfig,
    dtype: torch.dtype,
) -> SearchResult:
    """The best scales of one group (qcompile.quant.awq.search_scales), the loss the mean squared
    error of the parent's output with the trial weights against its output with the layer's own."""
    width = inputs[0].shape[-1]
    tokens = sum(x.numel() // width for x in inputs)
    x_mean = sum(x.float().abs().reshape(-1, width).sum(0) for x in inputs) / tokens  # [K]
    reference = [_parent_output(module, group, x, rope) for x in inputs]

    def run(weights: Sequence[torch.Tensor]) -> float:
        total, count = 0.0, 0
        with awq_groups.swapped(module, group.balance, weights):
            for x, ref in zip(inputs, reference, strict=True):
                total += float((_parent_output(module, group, x, rope) - ref).double().pow(2).sum())
                count += ref.numel()
        return total / count

    weights = [awq_groups.weight(module, b) for b in group.balance]
    return search_scales(x_mean, weights, quantized, run, config, dtype)
