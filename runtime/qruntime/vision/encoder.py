"""VisionEncoder: an artifact's vision graph (vision.onnx; docs/vision.md, "Artifacts") run by the
runtime's ops, from pixel_values and image_grid_thw to the image tokens' vision_embeds.

The graph takes what depends on the images' grids alone as inputs (pos_index, pos_weight,
rotary_cos, rotary_sin, cu_seqlens); the encoder computes them with tower_grid.py's functions, the
same the torch reference tower (tower.py) uses, and binds the graph's nodes once to the registry's
op implementations, as the text Plan does.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from pathlib import Path
from typing import Any

import onnx
import torch
from onnx import numpy_helper

from qruntime.artifact import ArtifactFormatError, artifact_path
from qruntime.ops.base import Op, OpBindError, OpEnv
from qruntime.ops.registry import reference_ops
from qruntime.plan import BoundNode, Plan, PlanError
from qruntime.vision.tower_config import VisionTowerConfig
from qruntime.vision.tower_grid import frame_bounds, grid_list, patch_coords, position_taps, rotary_cos_sin

VISION_INPUTS = ("pixel_values", "pos_index", "pos_weight", "rotary_cos", "rotary_sin", "cu_seqlens")
VISION_OUTPUT = "vision_embeds"
VISION_GRAPH = "vision.onnx"  # the default file name of the vision graph in an artifact


class VisionEncoder:
    """The vision graph bound to `weights` (initializer name → tensor; the graph's inline constants
    are read from the graph itself) on `device` in `dtype`. Call it with (pixel_values [P, patch_dim],
    image_grid_thw [images, 3]) → vision_embeds [P / m², (1 + D) · out_hidden_size]: per image token
    its embedding, then its D deepstack features."""

    def __init__(
        self,
        graph: onnx.ModelProto | onnx.GraphProto,
        weights: Mapping[str, torch.Tensor],
        config: VisionTowerConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        registry: Mapping[tuple[str, str], type[Op]] | None = None,
        fp8: torch.dtype = torch.float8_e4m3fn,
    ) -> None:
        body = graph.graph if isinstance(graph, onnx.ModelProto) else graph
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        tensors = {name: _runtime(tensor, self.device, dtype) for name, tensor in weights.items()}
        for init in body.initializer:
            if init.data_location != onnx.TensorProto.EXTERNAL and init.name not in tensors:
                tensors[init.name] = torch.from_numpy(numpy_helper.to_array(init).copy()).to(self.device)
        # no KV cache: no op here reads one; fp8: the artifact's target's format (an FP8 tower's weights)
        env = OpEnv(dtype, self.device, None, fp8=fp8)  # type: ignore[arg-type]
        self.plan = bind_graph(body, tensors, env, registry or reference_ops())
        self.weights = self.plan.weights

    def inputs(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
        """The graph's inputs for these images (checked against the config: errors name the input)."""
        c = self.config
        if pixel_values.dim() != 2 or pixel_values.shape[1] != c.patch_dim:
            raise ValueError(
                f"pixel_values must be [patches, {c.patch_dim}] (in_channels * temporal_patch_size * "
                f"patch_size**2), got shape {tuple(pixel_values.shape)}"
            )
        grids = grid_list(image_grid_thw, pixel_values.shape[0], c.spatial_merge_size)
        rows, cols, heights, widths = patch_coords(grids, c.spatial_merge_size, self.device)
        index, weight = position_taps(rows, cols, heights, widths, c.grid_side)  # [P, 4] each
        cos, sin = rotary_cos_sin(rows, cols, c.head_dim, c.rope_theta)
        return {
            "pixel_values": pixel_values.to(self.device, self.dtype),
            "pos_index": index.T.contiguous(),
            "pos_weight": weight.T.contiguous(),
            "rotary_cos": cos,
            "rotary_sin": sin,
            "cu_seqlens": frame_bounds(grids, self.device),
        }

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """vision_embeds [P / m², (1 + D) · out_hidden_size] in the encoder's dtype."""
        env: dict[str, torch.Tensor | None] = {**self.weights, **self.inputs(pixel_values, image_grid_thw), "": None}
        self.plan.run_nodes(None, env, 0, len(self.plan.nodes))  # type: ignore[arg-type]  # no step context
        return env[self.plan.output]  # type: ignore[return-value]


def bind_graph(
    graph: onnx.GraphProto,
    weights: Mapping[str, torch.Tensor],
    env: OpEnv,
    registry: Mapping[tuple[str, str], type[Op]],
) -> Plan:
    """The vision graph's nodes bound to the registry's ops (Plan.build's binding, for the vision
    graph's inputs and output). PlanError names the node at fault."""
    inputs = tuple(i.name for i in graph.input)
    if inputs != VISION_INPUTS:
        raise PlanError(f"vision graph inputs {list(inputs)} are not {list(VISION_INPUTS)}")
    if [o.name for o in graph.output] != [VISION_OUTPUT]:
        raise PlanError(f"vision graph outputs {[o.name for o in graph.output]} are not [{VISION_OUTPUT!r}]")
    missing = [init.name for init in graph.initializer if init.name not in weights]
    if missing:
        raise PlanError(f"vision graph initializers without a tensor: {missing[:5]}")
    known = set(weights) | set(inputs)
    last_use = {name: index for index, node in enumerate(graph.node) for name in node.input if name}
    bound = []
    for index, node in enumerate(graph.node):
        where = f"vision graph node {node.name!r} ({node.domain or 'ai.onnx'}::{node.op_type})"
        impl = registry.get((node.domain, node.op_type))
        if impl is None:
            raise PlanError(f"{where}: no implementation of this op")
        absent = [name for name in node.input if name and name not in known]
        if absent:
            raise PlanError(f"{where}: inputs {absent} are neither weights nor outputs of earlier nodes")
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
        try:
            op = impl(attrs, env, tuple(weights.get(name) if name else None for name in node.input))
        except OpBindError as exc:
            raise PlanError(f"{where}: {exc}") from exc
        known.update(node.output)
        release = tuple(
            n
            for n in dict.fromkeys(node.input)
            if n and last_use.get(n) == index and n not in weights and n not in inputs
        )
        bound.append(BoundNode(node.name, op, tuple(node.input), tuple(node.output), release))
    if VISION_OUTPUT not in known:
        raise PlanError(f"vision graph output {VISION_OUTPUT!r} is produced by no node")
    return Plan(tuple(bound), weights, VISION_OUTPUT)


def load_vision_encoder(
    root: str | Path,
    manifest_vision: Mapping[str, Any],
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    listed: Container[str] | None = None,
    synthetic: bool = False,
    backend: str = "reference",
    fp8: torch.dtype = torch.float8_e4m3fn,
) -> VisionEncoder:
    """The encoder of the artifact at `root`: manifest["vision"]'s `graph` (default vision.onnx) with
    its weights mapped from the artifact's safetensors, and `tower_config` (the checkpoint's
    vision_config). `listed`: the manifest's files, the only ones the graph may name. `synthetic`:
    a synthetic artifact's (qruntime.synthetic): random weights made on `device` instead. `backend`:
    "triton" binds the text path's GPU ops where it has them (DynamicQuant, PTPCLinear of an FP8
    tower), "reference" the torch ones. `fp8`: the FP8 format of the artifact's target
    (qruntime.target; e4m3fnuz for amd-gfx942), which the triton ops quantize activations to."""
    from qruntime.ops.registry import triton_ops
    from qruntime.rank import read_graph
    from qruntime.synthetic import random_initializers
    from qruntime.weights import load_initializers

    if "tower_config" not in manifest_vision:
        raise ArtifactFormatError("manifest vision: tower_config is missing")
    try:
        config = VisionTowerConfig.from_dict(manifest_vision["tower_config"])
    except ValueError as exc:
        raise ArtifactFormatError(f"manifest vision.tower_config: {exc}") from exc
    path = artifact_path(Path(root), manifest_vision.get("graph", VISION_GRAPH), listed=listed)
    graph = read_graph(path)
    device = torch.device(device)
    weights = (random_initializers if synthetic else load_initializers)(root, graph, device, dtype, listed=listed)
    try:
        registry = triton_ops() if backend == "triton" else reference_ops()
        return VisionEncoder(graph, weights, config, device, dtype, registry, fp8)
    except PlanError as exc:
        raise ArtifactFormatError(f"{path}: {exc}") from exc


def _runtime(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A weight on `device`, floating ones in the compute dtype but FP8 ones (an FP8 tower's
    quantized linears, recipe vision.scheme ptpc-fp8), which keep theirs."""
    from qruntime.weights import runtime_dtype

    return tensor.to(device=device, dtype=runtime_dtype(tensor.dtype, dtype))
