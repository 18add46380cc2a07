"""`w4a16-awq`: AWQ scales searched on calibration text, streaming the source one layer at a time.

For each decoder layer (source_layers.py: one layer's weights in memory, run in fp32) the
calibration hidden states go through the layer once, recording the inputs of the modules whose
output each group's loss is measured at (the smallest module holding the group, as llm-compressor's
AWQModifier takes it); then each group's scales are searched (qcompile.quant.awq) against the
unquantized module's output, and the layer's unchanged output becomes the next layer's input. The
groups, as AWQModifier's mappings for Qwen3:

    input_layernorm          -> q_proj, k_proj, v_proj   loss at self_attn's output
    v_proj (its rows)        -> o_proj                   only when v_proj's rows are o_proj's columns
                                                         (no grouped-query attention), as AWQModifier
    post_attention_layernorm -> gate_proj, up_proj       loss at the mlp's output
    up_proj (its rows)       -> down_proj                loss at down_proj's output

Memory: one layer, the hidden states of the calibration tokens and, while a layer is searched, the
four recorded inputs (model dtype). Dense models only (MoE experts: not yet).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from qcompile.compile.awq_scales import AwqScales
from qcompile.compile.calibrate import CalibrationError, calibration_ids
from qcompile.compile.source_layers import SourceLayers
from qcompile.errors import QCompileError
from qcompile.quant.awq import AwqConfig, search_scales
from qcompile.recipe.schema import Recipe
from qcompile.source import model as hf
from qcompile.source.checkpoint import Checkpoint

MIN_TOKENS = 512  # fewer calibration tokens than this give scales fitted to noise


@dataclass(frozen=True)
class Group:
    """One AWQ group: `smooth` (a norm, or a linear whose rows are divided), the `balance` linears
    that read its output, and the module (`parent`) whose output the loss compares."""

    smooth: str
    balance: tuple[str, ...]
    parent: str


GROUPS = (
    Group("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    Group("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
    Group("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    Group("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)


@dataclass(frozen=True)
class CalibrationSize:
    """How much calibration text a search uses: at most max_sequences sequences of seq_len tokens."""

    seq_len: int = 512
    max_sequences: int = 32
    batch: int = 4


def check_awq(checkpoint: Checkpoint) -> None:
    """QCompileError unless AWQ can run on the checkpoint (unquantized, dense)."""
    if checkpoint.quantization is not None:
        raise QCompileError(
            f"w4a16-awq searches scales on the unquantized model, and {checkpoint.path} is pre-quantized "
            f"({checkpoint.quantization.describe()}): compile its bf16 original"
        )
    if checkpoint.spec.moe is not None:
        raise QCompileError(f"w4a16-awq: {checkpoint.path} is a MoE model; AWQ for experts is not supported yet")


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
    check_awq(checkpoint)
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
            inputs = _run_layer(module, hidden, (cos, sin), size.batch)
            prefix = hf.layer_prefix(layer)
            for group in GROUPS:
                names = [f"{prefix}.{b}" for b in group.balance]
                quantized = [not recipe.ignores(n) for n in names]
                if not any(quantized) or not _compatible(module, group):
                    continue
                result = _search_group(module, group, inputs[group.parent], (cos, sin), quantized, config, source.dtype)
                for name in names:
                    columns[f"{name}.weight"] = _combine(columns.get(f"{name}.weight"), result.scales)
                smooth = f"{prefix}.{group.smooth}.weight"
                rows[smooth] = _combine(rows.get(smooth), result.scales)
                searched.append({"layer": layer, "smooth": group.smooth, **result.to_dict()})
            del inputs, module  # the layer's weights go before the next layer's are read
            if progress is not None:
                progress()
    if not torch.isfinite(hidden).all():
        raise CalibrationError("the source model's hidden states on the calibration text are not finite")
    digest = hashlib.sha256(Path(calib).read_bytes()).hexdigest()
    settings = {**asdict(config), **asdict(size)}
    return AwqScales(columns, rows, (Path(calib).name, digest, int(ids.numel())), tuple(searched), settings)


def _combine(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """Two groups scaling the same tensor (v_proj's columns by q/k/v's, its rows by o_proj's) act on
    different axes; one group never scales a tensor twice on the same axis."""
    if old is not None:
        raise ValueError("an AWQ group scales a tensor another group already scaled on the same axis")
    return new.float().contiguous()


def _compatible(module: Any, group: Group) -> bool:
    """False for v_proj -> o_proj under grouped-query attention (v_proj's rows are not o_proj's columns)."""
    smooth = module.get_submodule(group.smooth)
    if isinstance(smooth, torch.nn.Linear):
        return all(smooth.out_features == module.get_submodule(b).in_features for b in group.balance)
    return True


def _run_layer(module: Any, hidden: torch.Tensor, rope: tuple, batch: int) -> dict[str, list[torch.Tensor]]:
    """Run the layer over `hidden` in batches, replacing it with the layer's output; returns the
    input of every group's parent module, batch by batch, in the model dtype."""
    inputs: dict[str, list[torch.Tensor]] = {g.parent: [] for g in GROUPS}

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
    parent = module.get_submodule(group.parent)
    if group.parent == "self_attn":
        return parent(hidden_states=x.float(), position_embeddings=rope, attention_mask=None)[0]
    return parent(x.float())


def _search_group(
    module: Any,
    group: Group,
    inputs: Sequence[torch.Tensor],
    rope: tuple,
    quantized: Sequence[bool],
    config: AwqConfig,
    dtype: torch.dtype,
):
    """The best scales of one group (qcompile.quant.awq.search_scales), the loss the mean squared
    error of the parent's output with the trial weights against its output with the layer's own."""
    linears = [module.get_submodule(b) for b in group.balance]
    originals = [lin.weight.data for lin in linears]
    tokens = sum(x.shape[0] * x.shape[1] for x in inputs)
    x_mean = sum(x.float().abs().sum((0, 1)) for x in inputs) / tokens  # [K]
    reference = [_parent_output(module, group, x, rope) for x in inputs]

    def run(weights: Sequence[torch.Tensor]) -> float:
        for lin, w in zip(linears, weights, strict=True):
            lin.weight.data = w
        total, count = 0.0, 0
        for x, ref in zip(inputs, reference, strict=True):
            total += float((_parent_output(module, group, x, rope) - ref).double().pow(2).sum())
            count += ref.numel()
        return total / count

    try:
        return search_scales(
            x_mean, [module.get_submodule(b).weight.data for b in group.balance], quantized, run, config, dtype
        )
    finally:
        for lin, w in zip(linears, originals, strict=True):
            lin.weight.data = w
