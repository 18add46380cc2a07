"""The vision encoder (qruntime.vision.encoder: vision.onnx run by the runtime's ops) against the torch
reference tower (qruntime.vision.tower) and transformers' Qwen3VLVisionModel.

Small random towers (every parameter from a fresh printed seed), their graph built by qcompile's
build_vision_graph from a ModelSpec whose tower config is the model's vision_config, written with its
weights in a real safetensors file and loaded back by load_vision_encoder; several images of
different grids batched, one of several frames. Float32 on the CPU: each part of vision_embeds (the
embeddings, then each deepstack feature) must agree within 1e-5 of the reference's largest value.
"""

from __future__ import annotations

import json

import onnx
import pytest
import torch
from qruntime.artifact import ArtifactFormatError
from qruntime.vision import VisionTowerConfig, load_vision_tower
from qruntime.vision.encoder import VisionEncoder, load_vision_encoder
from safetensors.torch import load_file
from test_vision_tower import TEXT
from test_vision_tower import VISION as TOWER_VISION
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
from vision_artifacts import write_vision_artifact
from vision_random_models import randomize, seeded

from qcompile.graph.schemas import deregister_op_schemas, register_op_schemas

TOLERANCE = 1e-5  # max |ours - reference| / max |reference|, per part

# the tower test's tiny model, with three blocks and deepstack after the first and the last
VISION = {**TOWER_VISION, "depth": 3, "deepstack_visual_indexes": [0, 2]}
GRIDS = [(1, 4, 6), (1, 8, 8), (1, 2, 10), (2, 4, 4)]  # (t, h, w) in patches; the last has two frames
# bare towers: (overrides of VISION, grids)
BARE = {
    # no merging, one frame per patch, SiLU, another rotary base, one deepstack merger
    "merge1-silu": (
        {
            "spatial_merge_size": 1,
            "temporal_patch_size": 1,
            "hidden_act": "silu",
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [1],
            "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
        },
        [(1, 3, 5), (3, 2, 2), (1, 7, 1)],
    ),
    # merge 2, exact GELU, no deepstack: vision_embeds is the merger's output alone
    "merge2-gelu-no-deepstack": ({"hidden_act": "gelu", "deepstack_visual_indexes": []}, GRIDS),
}


def _inputs(config: VisionTowerConfig, grids, gen: torch.Generator):
    grid_thw = torch.tensor(grids, dtype=torch.int64)
    return torch.randn(int(grid_thw.prod(dim=1).sum()), config.patch_dim, generator=gen), grid_thw


def _assert_parts_match(ours: torch.Tensor, parts: list[torch.Tensor], what: str) -> None:
    """ours [N, (1+D)·H] against [embeddings, deepstack 0, …], each part within TOLERANCE of its max."""
    width = parts[0].shape[1]
    assert ours.shape == (parts[0].shape[0], width * len(parts)), what
    for i, (mine, theirs) in enumerate(zip(ours.split(width, dim=1), parts, strict=True)):
        error = ((mine - theirs).abs().max() / theirs.abs().max()).item()
        assert error < TOLERANCE, f"{what}: part {i} (0 = embeddings) off by {error:.2e} of its largest value"


@pytest.fixture(scope="module")
def op_schemas():
    register_op_schemas()
    yield
    deregister_op_schemas()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(checkpoint dir, its transformers model): a Qwen3VLForConditionalGeneration, save_pretrained."""
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(vision_config=VISION, text_config=TEXT))
    randomize(model, seeded())
    path = tmp_path_factory.mktemp("qwen3vl")
    model.save_pretrained(path)
    return path, model.eval()


def test_checkpoint_encoder_matches_reference_and_transformers(checkpoint, tmp_path, op_schemas):
    path, model = checkpoint
    vision_config = json.loads((path / "config.json").read_text())["vision_config"]
    tensors = load_file(path / "model.safetensors")
    write_vision_artifact(tmp_path, vision_config, tensors)
    onnx.checker.check_model(str(tmp_path / "vision.onnx"), full_check=True, check_custom_domain=True)
    manifest_vision = {"graph": "vision.onnx", "tower_config": vision_config}
    encoder = load_vision_encoder(tmp_path, manifest_vision, "cpu", torch.float32)

    config = VisionTowerConfig.from_dict(vision_config)
    pixel_values, grid_thw = _inputs(config, GRIDS, seeded())
    ours = encoder(pixel_values, grid_thw)
    embeddings, deepstack = load_vision_tower(tensors, config)(pixel_values, grid_thw)
    _assert_parts_match(ours, [embeddings, *deepstack], "reference tower")
    with torch.no_grad():
        expected = model.model.visual(pixel_values, grid_thw=grid_thw)
    _assert_parts_match(ours, [expected.pooler_output, *expected.deepstack_features], "transformers")


@pytest.mark.parametrize("case", sorted(BARE))
def test_bare_tower_encoder_matches_reference(case, tmp_path):
    overrides, grids = BARE[case]
    vision_config = {**VISION, **overrides}
    gen = seeded()
    model = Qwen3VLVisionModel(Qwen3VLVisionConfig(**vision_config)).eval()
    randomize(model, gen)
    tensors = {"model.visual." + name: t for name, t in model.state_dict().items()}
    graph = write_vision_artifact(tmp_path, vision_config, tensors)
    config = VisionTowerConfig.from_dict(vision_config)
    encoder = VisionEncoder(graph, tensors, config, "cpu", torch.float32)

    pixel_values, grid_thw = _inputs(config, grids, gen)
    ours = encoder(pixel_values, grid_thw)
    embeddings, deepstack = load_vision_tower(tensors, config)(pixel_values, grid_thw)
    assert len(deepstack) == len(vision_config["deepstack_visual_indexes"])
    _assert_parts_match(ours, [embeddings, *deepstack], "reference tower")


def test_images_in_a_batch_do_not_see_each_other(checkpoint, tmp_path):
    """Each image alone gives its rows of the batch (attention and positions stay within an image)."""
    path, _ = checkpoint
    vision_config = json.loads((path / "config.json").read_text())["vision_config"]
    tensors = load_file(path / "model.safetensors")
    config = VisionTowerConfig.from_dict(vision_config)
    graph = write_vision_artifact(tmp_path, vision_config, tensors)
    encoder = VisionEncoder(graph, tensors, config, "cpu", torch.float32)
    pixel_values, grid_thw = _inputs(config, GRIDS, seeded())
    batch = encoder(pixel_values, grid_thw)
    start = row = 0
    for grid in GRIDS:
        size = grid[0] * grid[1] * grid[2]
        alone = encoder(pixel_values[start : start + size], torch.tensor([grid]))
        rows = batch[row : row + size // config.merge_unit]  # the same sums in another order: fp32 noise
        parts = rows.split(rows.shape[1] // (1 + len(vision_config["deepstack_visual_indexes"])), dim=1)
        _assert_parts_match(alone, list(parts), f"image {grid} alone against its rows of the batch")
        start, row = start + size, row + size // config.merge_unit


def test_bfloat16_encoder_runs_in_bfloat16(checkpoint, tmp_path):
    """Weights stored in bfloat16 and run in bfloat16: the output's dtype, and a loose agreement with
    the reference tower run in bfloat16 on the same weights (roundings differ by op order)."""
    path, _ = checkpoint
    vision_config = json.loads((path / "config.json").read_text())["vision_config"]
    tensors = load_file(path / "model.safetensors")
    write_vision_artifact(tmp_path, vision_config, tensors, dtype="bfloat16")
    encoder = load_vision_encoder(tmp_path, {"tower_config": vision_config}, "cpu", torch.bfloat16)
    config = encoder.config
    pixel_values, grid_thw = _inputs(config, GRIDS, seeded())
    ours = encoder(pixel_values, grid_thw)
    assert ours.dtype == torch.bfloat16
    bf16 = {name: t.to(torch.bfloat16) for name, t in tensors.items() if name.startswith("model.visual.")}
    embeddings, deepstack = load_vision_tower(bf16, config)(pixel_values.to(torch.bfloat16), grid_thw)
    reference = torch.cat([embeddings, *deepstack], dim=1).float()
    assert ((ours.float() - reference).abs().max() / reference.abs().max()).item() < 0.03


@pytest.mark.parametrize(
    "manifest_vision, named",
    [
        ({}, "tower_config is missing"),
        ({"tower_config": {**VISION, "depth": 0}}, "depth must be a positive integer"),
        ({"tower_config": VISION, "graph": "nothing.onnx"}, "nothing.onnx: missing"),
    ],
)
def test_loader_refuses_a_bad_manifest_entry(tmp_path, manifest_vision, named):
    with pytest.raises(ArtifactFormatError, match=named):
        load_vision_encoder(tmp_path, manifest_vision, "cpu", torch.float32)


def test_wrong_pixel_values_width_is_refused(checkpoint, tmp_path):
    path, _ = checkpoint
    vision_config = json.loads((path / "config.json").read_text())["vision_config"]
    tensors = load_file(path / "model.safetensors")
    config = VisionTowerConfig.from_dict(vision_config)
    encoder = VisionEncoder(
        write_vision_artifact(tmp_path, vision_config, tensors), tensors, config, "cpu", torch.float32
    )
    with pytest.raises(ValueError, match=rf"pixel_values must be \[patches, {config.patch_dim}\]"):
        encoder(torch.ones(16, config.patch_dim + 1), torch.tensor([[1, 4, 4]]))
