"""The Qwen3-VL vision tower (qruntime.vision.tower) against transformers 5.17's Qwen3VLVisionModel.

Small random models (fresh seed per run, printed): every parameter, LayerNorms and biases included,
set from that seed, so no weight sits at its neutral init. The dense and MoE
ForConditionalGeneration models are saved with save_pretrained and read back the way a checkpoint
is (config.json's vision_config, the safetensors' model.visual.* tensors); a bare
Qwen3VLVisionModel covers other settings. Images of different grids are batched together (position
embeddings upsampled and downsampled, a 2-frame grid), and the embeddings and every deepstack
feature must agree within 1e-5 of the reference's largest value, in float32 on the CPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from qruntime.vision import VisionTower, VisionTowerConfig, load_vision_tower, tower_tensor_shapes
from safetensors.torch import load_file
from transformers import (
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
from vision_random_models import randomize, seeded

TOLERANCE = 1e-5  # max |ours - reference| / max |reference|

VISION = {
    "depth": 4,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_heads": 4,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "in_channels": 3,
    "out_hidden_size": 48,
    "num_position_embeddings": 36,  # a 6 x 6 grid: the 8 x 8 image upsamples it, the 2 x 10 one both ways
    "deepstack_visual_indexes": [1, 2],
    "hidden_act": "gelu_pytorch_tanh",
}
TEXT = {
    "vocab_size": 96,
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 24,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4]},
}
MOE_TEXT = {**TEXT, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
GRIDS = [(1, 4, 6), (1, 8, 8), (1, 2, 10), (2, 4, 4)]  # (t, h, w) in patches; the last has two frames


def _inputs(config: VisionTowerConfig, grids: list[tuple[int, int, int]], gen: torch.Generator):
    grid_thw = torch.tensor(grids, dtype=torch.int64)
    patches = int(grid_thw.prod(dim=1).sum())
    return torch.randn(patches, config.patch_dim, generator=gen), grid_thw


def _relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def _assert_matches(tower: VisionTower, reference: torch.nn.Module, pixel_values, grid_thw) -> None:
    with torch.no_grad():
        expected = reference(pixel_values, grid_thw=grid_thw)
    embeddings, deepstack = tower(pixel_values, grid_thw)
    merged = int(grid_thw.prod(dim=1).sum()) // tower.config.merge_unit
    assert embeddings.shape == (merged, tower.config.out_hidden_size)
    assert embeddings.shape == expected.pooler_output.shape
    assert _relative(embeddings, expected.pooler_output) < TOLERANCE
    assert len(deepstack) == len(expected.deepstack_features) == len(tower.config.deepstack_visual_indexes)
    for i, (ours, theirs) in enumerate(zip(deepstack, expected.deepstack_features, strict=True)):
        assert ours.shape == theirs.shape == embeddings.shape, i
        assert _relative(ours, theirs) < TOLERANCE, f"deepstack feature {i}"


@pytest.fixture(scope="module", params=["dense", "moe"])
def checkpoint(request, tmp_path_factory):
    """(checkpoint dir, its transformers model) for Qwen3VL / Qwen3VLMoe ForConditionalGeneration."""
    gen = seeded()
    if request.param == "dense":
        model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(vision_config=VISION, text_config=TEXT))
    else:
        model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(vision_config=VISION, text_config=MOE_TEXT))
    randomize(model, gen)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path, model.eval()


def _read(path) -> tuple[VisionTowerConfig, dict[str, torch.Tensor]]:
    config = json.loads((path / "config.json").read_text())
    return VisionTowerConfig.from_dict(config["vision_config"]), load_file(path / "model.safetensors")


def test_checkpoint_tower_matches_transformers(checkpoint):
    path, model = checkpoint
    config, tensors = _read(path)
    assert any(not name.startswith("model.visual.") for name in tensors)  # the text model's are passed over
    tower = load_vision_tower(tensors, config)
    _assert_matches(tower, model.model.visual, *_inputs(config, GRIDS, seeded()))


def test_each_image_alone_equals_its_rows_in_a_batch(checkpoint):
    """Attention and position embeddings stay within an image: batching changes no image's tokens."""
    config, tensors = _read(checkpoint[0])
    tower = load_vision_tower(tensors, config)
    pixel_values, grid_thw = _inputs(config, GRIDS, seeded())
    batch, batch_deepstack = tower(pixel_values, grid_thw)
    start = merged_start = 0
    for grid in GRIDS:
        size = grid[0] * grid[1] * grid[2]
        alone, alone_deepstack = tower(pixel_values[start : start + size], torch.tensor([grid]))
        rows = slice(merged_start, merged_start + size // config.merge_unit)
        torch.testing.assert_close(alone, batch[rows], rtol=1e-5, atol=1e-5)
        for ours, batched in zip(alone_deepstack, batch_deepstack, strict=True):
            torch.testing.assert_close(ours, batched[rows], rtol=1e-5, atol=1e-5)
        start, merged_start = start + size, rows.stop


@pytest.mark.parametrize(
    "overrides, grids",
    [
        # no merging, one frame per patch, exact GELU, a 4 x 4 position grid, another rotary base
        (
            {
                "spatial_merge_size": 1,
                "temporal_patch_size": 1,
                "hidden_act": "gelu",
                "num_position_embeddings": 16,
                "deepstack_visual_indexes": [0],
                "depth": 3,
                "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
            },
            [(1, 3, 5), (3, 2, 2), (1, 7, 1)],
        ),
        # merge 4, 8 heads of 16, one channel, no deepstack, the first image a single merge window
        (
            {
                "spatial_merge_size": 4,
                "num_heads": 8,
                "hidden_size": 128,
                "in_channels": 1,
                "deepstack_visual_indexes": [],
            },
            [(1, 4, 4), (1, 12, 8), (2, 8, 4)],
        ),
    ],
)
def test_bare_vision_model_matches_transformers(overrides, grids):
    gen = seeded()
    reference = Qwen3VLVisionModel(Qwen3VLVisionConfig(**{**VISION, **overrides})).eval()
    randomize(reference, gen)
    config = VisionTowerConfig.from_dict({**VISION, **overrides})
    tower = load_vision_tower(reference.state_dict(), config, prefix="")
    _assert_matches(tower, reference, *_inputs(config, grids, gen))


def test_published_config_reads():
    """The vision_config of the published Qwen3-VL-4B-Instruct (model_type qwen3_vl, no rope keys)."""
    published = {
        "deepstack_visual_indexes": [5, 11, 17],
        "depth": 24,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1024,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4096,
        "model_type": "qwen3_vl",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2560,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    config = VisionTowerConfig.from_dict(published)
    assert (config.head_dim, config.grid_side, config.patch_dim, config.rope_theta) == (64, 48, 1536, 10000.0)
    assert config.deepstack_visual_indexes == (5, 11, 17)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"depth": None}, "depth is missing"),
        ({"surprise": 1}, "unknown key 'surprise'"),
        ({"hidden_size": 0}, "hidden_size must be a positive integer"),
        ({"patch_size": [4, 4]}, "patch_size must be a positive integer"),
        ({"num_heads": True}, "num_heads must be a positive integer"),
        ({"num_heads": 5}, "not a multiple of num_heads"),
        ({"num_heads": 8, "hidden_size": 48}, "multiple of 4"),
        ({"num_position_embeddings": 35}, "num_position_embeddings must be a square"),
        ({"deepstack_visual_indexes": [1, 4]}, "deepstack_visual_indexes must be block indexes"),
        ({"deepstack_visual_indexes": [2, 1]}, "deepstack_visual_indexes must be increasing"),
        ({"deepstack_visual_indexes": 1}, "deepstack_visual_indexes must be a list"),
        ({"hidden_act": "relu6"}, "hidden_act 'relu6' is not supported"),
        ({"model_type": "qwen2_5_vl"}, "model_type 'qwen2_5_vl'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type 'yarn'"),
        ({"rope_parameters": {"rope_theta": -1.0}}, "rope_theta must be a positive number"),
        ({"rope_parameters": {"factor": 2.0}}, "rope_parameters key 'factor'"),
        ({"rope_theta": 5.0, "rope_parameters": {"rope_theta": 6.0}}, "differ"),
    ],
)
def test_config_refused_naming_the_key(change, named):
    vision_config = {**VISION, **change}
    vision_config = {key: value for key, value in vision_config.items() if value is not None}
    with pytest.raises(ValueError, match=f"vision_config.*{named}"):
        VisionTowerConfig.from_dict(vision_config)


def test_legacy_rope_theta_is_read():
    assert VisionTowerConfig.from_dict({**VISION, "rope_theta": 123.0}).rope_theta == 123.0


@pytest.fixture
def tensors() -> tuple[VisionTowerConfig, dict[str, torch.Tensor]]:
    config = VisionTowerConfig.from_dict(VISION)
    gen = seeded()
    state = {
        "model.visual." + name: torch.randn(shape, generator=gen) for name, shape in tower_tensor_shapes(config).items()
    }
    state["model.language_model.embed_tokens.weight"] = torch.randn(4, 4, generator=gen)
    return config, state


def test_state_dict_missing_tensor_refused(tensors):
    config, state = tensors
    del state["model.visual.blocks.2.attn.qkv.bias"]
    with pytest.raises(ValueError, match=r"tensor model\.visual\.blocks\.2\.attn\.qkv\.bias is missing"):
        load_vision_tower(state, config)


def test_state_dict_wrong_shape_refused(tensors):
    config, state = tensors
    state["model.visual.deepstack_merger_list.1.norm.weight"] = torch.ones(64)
    with pytest.raises(
        ValueError, match=r"deepstack_merger_list\.1\.norm\.weight has shape \(64,\), expected \(256,\)"
    ):
        load_vision_tower(state, config)


def test_state_dict_unexpected_tensor_refused(tensors):
    config, state = tensors
    state["model.visual.blocks.4.norm1.weight"] = torch.ones(64)  # a fifth block in a four-block config
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.visual\.blocks\.4\.norm1\.weight'"):
        load_vision_tower(state, config)


def test_state_dict_mixed_dtypes_refused(tensors):
    config, state = tensors
    state["model.visual.merger.linear_fc2.bias"] = state["model.visual.merger.linear_fc2.bias"].to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"merger\.linear_fc2\.bias is torch\.bfloat16"):
        load_vision_tower(state, config)


def test_dtype_follows_the_weights(tensors):
    config, state = tensors
    tower = load_vision_tower({name: t.to(torch.bfloat16) for name, t in state.items()}, config)
    embeddings, deepstack = tower(*_inputs(config, [(1, 2, 4)], seeded()))
    assert embeddings.dtype == torch.bfloat16 and all(d.dtype == torch.bfloat16 for d in deepstack)
    assert embeddings.shape == (2, 48)


@pytest.mark.parametrize(
    "pixels, grids, named",
    [
        ((16, 96), [(1, 4, 6)], "image_grid_thw covers 24 patches, but pixel_values has 16 rows"),
        ((24, 95), [(1, 4, 6)], r"pixel_values must be \[patches, 96\]"),
        ((15, 96), [(1, 3, 5)], "multiples of spatial_merge_size"),
        ((24, 96), [(0, 4, 6)], "must be positive"),
    ],
)
def test_inputs_refused(tensors, pixels, grids, named):
    config, state = tensors
    tower = load_vision_tower(state, config)
    with pytest.raises(ValueError, match=named):
        tower(torch.randn(pixels), torch.tensor(grids))
