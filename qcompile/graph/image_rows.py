"""Qwen3-VL's image rows in the text graph (docs/vision.md, "Artifacts").

A ModelSpec with `vision` set takes two more graph inputs: `vision_rows` [Nv, 1], the step's rows holding
image tokens, and `vision_embeds` [Nv, (1+D)*H], each such row's image embedding then its D DeepStack
features side by side. The embedding part is written over the token embeddings' rows (ScatterND,
reduction "none"); feature i is added to the hidden state after decoder layer i < D (ScatterND, reduction
"add"), after the layer's residual sum, so at tp > 1 after the all-reduce, the same on every rank.
"""

from __future__ import annotations

import torch

from qcompile.errors import PlanError
from qcompile.graph.builder import GraphBuilder
from qcompile.recipe.schema import Recipe
from qcompile.source.spec import ModelSpec

VISION_ROWS = "vision_rows"
VISION_EMBEDS = "vision_embeds"
POSITIONS_SHAPE = (3, "T")  # M-RoPE: each token's (temporal, height, width) position


def vision_inputs(b: GraphBuilder) -> tuple[str, tuple[str, ...]]:
    """Declare `vision_rows` and `vision_embeds` and split the latter: (image part, the D features)."""
    spec = b.spec
    assert spec.vision is not None, "vision_inputs called on a text-only model"
    hidden, depth = spec.hidden_size, spec.vision.deepstack_layers
    b.input(VISION_ROWS, torch.int64, ("Nv", 1))
    b.input(VISION_EMBEDS, b.dtype, ("Nv", (1 + depth) * hidden))
    if depth == 0:
        return VISION_EMBEDS, ()
    names = [f"{VISION_EMBEDS}.image", *(f"{VISION_EMBEDS}.deepstack.{i}" for i in range(depth))]
    parts = b.node(
        "Split",
        [VISION_EMBEDS, b.constant([hidden] * (1 + depth))],
        [b.act(name, ("Nv", hidden)) for name in names],
        {"axis": -1},
        name=f"{VISION_EMBEDS}.split",
    )
    return parts[0], parts[1:]


def scatter_rows(b: GraphBuilder, data: str, updates: str, out: str, reduction: str) -> str:
    """ScatterND(data [T, H], vision_rows, updates [Nv, H]): the image rows of `data` replaced by
    (reduction "none") or increased by ("add") the rows of `updates`."""
    return b.node("ScatterND", [data, VISION_ROWS, updates], [b.act(out, b.shape(data))], {"reduction": reduction})[0]


def mrope_attrs(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The `mrope_section` attribute of the rope ops of a Qwen3-VL model; none for Qwen3."""
    if spec.vision is None:
        return {}
    return {"mrope_section": tuple(int(s) for s in spec.vision.mrope_section)}


def check_vision(spec: ModelSpec, recipe: Recipe) -> None:
    """PlanError when the vision parts of `spec` cannot make a text graph: an M-RoPE section that is not
    three non-negative sizes summing to head_dim / 2, or more DeepStack layers than decoder layers."""
    vision = spec.vision
    if vision is None:
        return
    section = vision.mrope_section
    if len(section) != 3 or any(s < 0 for s in section) or sum(section) != spec.head_dim // 2:
        raise PlanError(
            f"recipe {recipe.name!r}: {spec.architecture} vision.mrope_section {list(section)} must be three "
            f"non-negative sizes summing to head_dim / 2 = {spec.head_dim // 2}"
        )
    if not 0 <= vision.deepstack_layers <= spec.num_hidden_layers:
        raise PlanError(
            f"recipe {recipe.name!r}: {spec.architecture} vision.deepstack_layers {vision.deepstack_layers} "
            f"is not between 0 and the {spec.num_hidden_layers} decoder layers"
        )
