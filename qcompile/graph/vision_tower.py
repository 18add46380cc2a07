"""build_vision_graph: the Qwen3-VL vision tower as a graph of its own (vision.onnx; docs/vision.md,
"Artifacts", "The vision graph").

Inputs pixel_values [P, C·tp·p²] (model dtype), pos_index int64 [4, P], pos_weight float32 [4, P],
rotary_cos / rotary_sin float32 [P, d_v], cu_seqlens int32 [S+1]; output vision_embeds
[P/m², (1+D)·H]: per image token its embedding, then its D DeepStack features. The nodes compute
what qruntime.vision.tower computes, in its order: the patch embedding as a Gemm over the flattened
patches (the Conv3d weight Reshaped to [C_v, C·tp·p²]), plus PositionGrid; `depth` pre-norm blocks
(LayerNormalization, qkv Gemm, VisionAttention, proj Gemm, Add, LayerNormalization, fc1 Gemm, the
activation, fc2 Gemm, Add); after each block of deepstack_visual_indexes its deepstack merger
(Reshape to [P/m², m²·C_v], then LayerNormalization, fc1, exact Gelu, fc2) and after the last block
the merger (LayerNormalization per patch, then the Reshape, fc1, Gelu, fc2); then Concat(axis -1)
of [merger, deepstack 0, …].

Every tower tensor is one unquantized weight job that writes it under its checkpoint name
(`model.visual.…`, biases included), see TowerTensorJob; role "vision", so nothing that reads the
text model's roles (embedding bytes, unquantized linears) counts them. Under recipe vision.scheme
ptpc-fp8 the blocks' four linears are instead ptpc-fp8 weight jobs (role "vision") run as
DynamicQuant + PTPCLinear + Add of the bias (docs/vision.md, "FP8 tower").
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType

import torch
from qruntime.vision.tower_config import VisionTowerConfig
from qruntime.vision.tower_weights import DEFAULT_PREFIX, tower_tensor_shapes

from qcompile.compile.jobs import WeightJob
from qcompile.errors import PlanError
from qcompile.graph.builder import GraphBuilder
from qcompile.graph.ir import AttrValue, Dim, Graph, TensorType, check_graph
from qcompile.quant import get_scheme
from qcompile.recipe.schema import Recipe
from qcompile.source.spec import ModelSpec

# name, dtype (None: the model dtype), shape of the vision graph's inputs, in contract order
VISION_GRAPH_INPUTS = (
    ("pixel_values", None, ("P", "patch_dim")),
    ("pos_index", torch.int64, (4, "P")),
    ("pos_weight", torch.float32, (4, "P")),
    ("rotary_cos", torch.float32, ("P", "head_dim")),
    ("rotary_sin", torch.float32, ("P", "head_dim")),
    ("cu_seqlens", torch.int32, ("S+1",)),
)
VISION_EMBEDS = "vision_embeds"
LAYER_NORM_EPS = 1e-6  # every LayerNorm of the tower (transformers' Qwen3VLVisionModel)
VISION_ROLE = "vision"  # the job role of every tower tensor (jobs.ROLES)


@dataclass(frozen=True)
class TowerTensorJob(WeightJob):
    """A tower tensor copied as it is (scheme "none"), written under its own checkpoint name: unlike a
    decoder job's `{name}.weight`, a bias stays `….bias` (the job's name is the tensor's)."""

    @property
    def weight_name(self) -> str:
        return self.name


class VisionGraph(Graph):
    """The vision graph: a Graph whose weights are the tower's tensors (shapes from its config)."""

    @cached_property
    def weight_tensors(self) -> Mapping[str, TensorType]:
        shapes = vision_tensor_shapes(self.spec)
        out: dict[str, TensorType] = {}
        for job in self.weights.values():
            for tensor in job.outputs(shapes, self.model_dtype):
                out[tensor.name] = TensorType(tensor.dtype, tensor.shape)
        return MappingProxyType(out)


def tower_config(spec: ModelSpec) -> VisionTowerConfig:
    """The spec's vision tower config; PlanError when the spec has none or it does not read."""
    if spec.vision is None:
        raise PlanError(f"{spec.architecture} has no vision tower (ModelSpec.vision is not set)")
    try:
        return VisionTowerConfig.from_dict(json.loads(spec.vision.tower_config))
    except (ValueError, TypeError) as exc:
        raise PlanError(f"{spec.architecture}: vision tower config: {exc}") from exc


def vision_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Checkpoint name (`model.visual.…`) → shape of every tower tensor the vision graph reads."""
    return {DEFAULT_PREFIX + name: shape for name, shape in tower_tensor_shapes(tower_config(spec)).items()}


class _Builder(GraphBuilder):
    """GraphBuilder (inputs, constants, nodes, DynamicQuant) with the tower's own helpers: every value
    one node's single output in the model dtype, weights the tower's tensors under their checkpoint names."""

    def __init__(self, spec: ModelSpec, config: VisionTowerConfig, recipe: Recipe) -> None:
        super().__init__(spec, recipe)
        self.config = config

    def tensor(self, name: str) -> str:
        """The tower tensor `name` (without the prefix), declared as its own job."""
        full = DEFAULT_PREFIX + name
        if full not in self.weights:
            self.weights[full] = TowerTensorJob(full, ((full,),), stacked=False, scheme="none", role=VISION_ROLE)
        return full

    def value(
        self,
        op_type: str,
        inputs: Sequence[str],
        out: str,
        shape: tuple[Dim, ...],
        attrs: Mapping[str, AttrValue] | None = None,
    ) -> str:
        """One node of one output `out` (model dtype, `shape`), named after its output."""
        return self.node(op_type, inputs, [self.act(out, shape)], attrs)[0]

    def affine(self, x: str, module: str, out_features: int, out: str, *, quantizable: bool = False) -> str:
        """y = x Wᵀ + b with `module`'s weight and bias: a Gemm with its bias input C, or, for a
        `quantizable` linear under recipe vision.scheme ptpc-fp8, the text model's FP8 linear
        (DynamicQuant of x per token, PTPCLinear with the weight job `module` quantized per output
        channel) and an Add of the bias, which stays in the model dtype."""
        rows = self.types[x].shape[0]
        scheme = get_scheme(self.recipe.vision.scheme if quantizable else "none")
        if not scheme.quantized:
            inputs = [x, self.tensor(f"{module}.weight"), self.tensor(f"{module}.bias")]
            return self.value("Gemm", inputs, out, (rows, out_features), {"transB": 1})
        full = DEFAULT_PREFIX + module
        job = WeightJob(full, ((f"{full}.weight",),), stacked=False, scheme=scheme.name, role=VISION_ROLE)
        self.weights[full] = job
        assert job.scale_name is not None
        xq, xs = self.quantize(x, scheme.activation_group)
        y = self.value(
            scheme.linear_op, [xq, xs, job.weight_name, job.scale_name], out + ".linear", (rows, out_features)
        )
        return self.add(y, self.tensor(f"{module}.bias"), out)

    def layer_norm(self, x: str, module: str, out: str) -> str:
        inputs = [x, self.tensor(f"{module}.weight"), self.tensor(f"{module}.bias")]
        return self.value(
            "LayerNormalization", inputs, out, self.types[x].shape, {"axis": -1, "epsilon": LAYER_NORM_EPS}
        )

    def add(self, a: str, b: str, out: str) -> str:
        return self.value("Add", [a, b], out, self.types[a].shape)

    def reshape(self, x: str, shape: tuple[int, ...], out: str, out_shape: tuple[Dim, ...]) -> str:
        return self.value("Reshape", [x, self.constant(shape)], out, out_shape)


def build_vision_graph(spec: ModelSpec, recipe: Recipe | None = None) -> VisionGraph:
    """The vision graph of `spec` (whose `vision` must be set), its weights every tower tensor in the
    model dtype, but the blocks' linears FP8 under `recipe`'s vision.scheme ptpc-fp8. PlanError when
    the spec has no readable vision tower config."""
    c = tower_config(spec)
    b = _Builder(spec, c, recipe or Recipe())
    sizes = {"patch_dim": c.patch_dim, "head_dim": c.head_dim}
    for name, dtype, shape in VISION_GRAPH_INPUTS:
        b.input(name, dtype or b.dtype, tuple(sizes.get(d, d) if isinstance(d, str) else d for d in shape))
    hidden = c.hidden_size
    patch_weight = b.reshape(
        b.tensor("patch_embed.proj.weight"), (hidden, c.patch_dim), "patch_embed.proj.weight_2d", (hidden, c.patch_dim)
    )
    x = b.value(
        "Gemm",
        ["pixel_values", patch_weight, b.tensor("patch_embed.proj.bias")],
        "patch_embed",
        ("P", hidden),
        {"transB": 1},
    )
    pos = b.value("PositionGrid", [b.tensor("pos_embed.weight"), "pos_index", "pos_weight"], "pos_embed", ("P", hidden))
    x = b.add(x, pos, "embeds")
    deepstack = []
    for i in range(c.depth):
        x = _block(b, i, x)
        if i in c.deepstack_visual_indexes:
            j = c.deepstack_visual_indexes.index(i)
            deepstack.append(_merger(b, f"deepstack_merger_list.{j}", x, postshuffle=True))
    final = _merger(b, "merger", x, postshuffle=False)
    merged_rows = "P" if c.merge_unit == 1 else f"P/{c.merge_unit}"
    if deepstack:
        width = (1 + len(deepstack)) * c.out_hidden_size
        b.value("Concat", [final, *deepstack], VISION_EMBEDS, (merged_rows, width), {"axis": -1})
    graph = VisionGraph(
        spec=spec,
        nodes=tuple(b.nodes),
        inputs=tuple(b.inputs),
        outputs=(VISION_EMBEDS,),
        types=b.types,
        weights=b.weights,
        constants=b.constants,
        metadata={"architecture": spec.architecture, "graph": "vision"},
    )
    check_graph(graph)
    return graph


def _block(b: _Builder, i: int, x: str) -> str:
    """Block i: x + proj(attention(norm1(x))), then that + fc2(act(fc1(norm2(·))))."""
    c, p = b.config, f"blocks.{i}."
    hidden = c.hidden_size
    h = b.layer_norm(x, p + "norm1", p + "norm1")
    qkv = b.affine(h, p + "attn.qkv", 3 * hidden, p + "attn.qkv", quantizable=True)
    attrs = {"num_heads": c.num_heads, "head_dim": c.head_dim, "scale": float(c.head_dim**-0.5)}
    attn = b.value("VisionAttention", [qkv, "rotary_cos", "rotary_sin", "cu_seqlens"], p + "attn", ("P", hidden), attrs)
    h = b.add(x, b.affine(attn, p + "attn.proj", hidden, p + "attn.proj", quantizable=True), p + "attn_residual")
    y = b.layer_norm(h, p + "norm2", p + "norm2")
    fc1 = b.affine(y, p + "mlp.linear_fc1", c.intermediate_size, p + "mlp.linear_fc1", quantizable=True)
    y = _activation(b, fc1, p + "mlp.act")
    return b.add(h, b.affine(y, p + "mlp.linear_fc2", hidden, p + "mlp.linear_fc2", quantizable=True), p + "hidden")


def _activation(b: _Builder, x: str, out: str) -> str:
    """The blocks' MLP activation (tower_config.TOWER_ACTIVATIONS): Gelu tanh / exact, or SiLU as x·σ(x)."""
    shape, act = b.types[x].shape, b.config.hidden_act
    if act == "gelu_pytorch_tanh":
        return b.value("Gelu", [x], out, shape, {"approximate": "tanh"})
    if act == "gelu":
        return b.value("Gelu", [x], out, shape, {"approximate": "none"})
    if act == "silu":
        return b.value("Mul", [x, b.value("Sigmoid", [x], out + ".sigmoid", shape)], out, shape)
    raise PlanError(f"vision tower: hidden_act {act!r} has no graph form")


def _merger(b: _Builder, p: str, x: str, *, postshuffle: bool) -> str:
    """m x m consecutive patches → one token of out_hidden_size: the LayerNorm after the
    concatenation (deepstack mergers, `postshuffle`) or per patch before it (the merger)."""
    c = b.config
    merged, rows = c.merged_hidden_size, ("P" if c.merge_unit == 1 else f"P/{c.merge_unit}")
    if postshuffle:
        y = b.layer_norm(b.reshape(x, (-1, merged), p + ".shuffle", (rows, merged)), p + ".norm", p + ".norm")
    else:
        y = b.reshape(b.layer_norm(x, p + ".norm", p + ".norm"), (-1, merged), p + ".shuffle", (rows, merged))
    y = b.value("Gelu", [b.affine(y, p + ".linear_fc1", merged, p + ".linear_fc1")], p + ".act", (rows, merged))
    out = p + ".linear_fc2" if postshuffle or c.deepstack_visual_indexes else VISION_EMBEDS
    return b.affine(y, p + ".linear_fc2", c.out_hidden_size, out)
