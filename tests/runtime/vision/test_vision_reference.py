"""The whole-model Qwen3-VL reference (qruntime.vision.reference) against transformers 5.17.

Tiny random Qwen3VLForConditionalGeneration (tied head) and Qwen3VLMoeForConditionalGeneration (own
head, a dense layer among the sparse ones), every parameter drawn from a fresh seed printed each run,
saved with save_pretrained and read back from the directory. Prompts with 0, 1 and 3 images of
different grids (one of two temporal patches), their image tokens expanded as the processor does;
the logits at every position must agree with transformers' within 1e-5 of the largest, in float32
on the CPU, and the greedy next token must be the same.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from qruntime.vision import load_reference
from qruntime.vision.reference import read_config
from qwen3_vl_checkpoints import END, IMAGE, MOE, START, TEXT, VISION, write_checkpoint
from qwen3_vl_checkpoints import TOKEN_IDS as IDS
from safetensors.torch import load_file, save_file
from transformers import (
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)
from vision_random_models import randomize, seeded

TOLERANCE = 1e-5  # max |ours - reference| / max |reference|
TEXT_IDS = range(0, IMAGE)
MOE_TEXT = dict(TEXT, **MOE)
# 2 * moe_intermediate_size != hidden_size: a transposed gate_up_proj is told apart by its shape
GRIDS = {0: [], 1: [(1, 4, 6)], 3: [(1, 8, 8), (2, 4, 4), (1, 2, 10)]}  # (t, h, w) in patches


@pytest.fixture(scope="module", params=["dense", "moe"])
def checkpoint(request, tmp_path_factory):
    """(checkpoint dir, its transformers model): dense with a tied head, MoE with its own."""
    path = tmp_path_factory.mktemp(request.param)
    model = write_checkpoint(path, request.param)
    return path, model


def _prompt(grids: list[tuple[int, int, int]], rng: random.Random, merge: int = 2) -> list[int]:
    """Text, then per image vision_start, its t*h*w/merge² image tokens, vision_end and more text."""
    ids = [rng.choice(TEXT_IDS) for _ in range(rng.randint(1, 5))]
    for t, h, w in grids:
        ids += [START] + [IMAGE] * (t * h * w // merge**2) + [END]
        ids += [rng.choice(TEXT_IDS) for _ in range(rng.randint(1, 5))]
    return ids


def _inputs(images: int, gen: torch.Generator):
    rng = random.Random(int(torch.randint(1 << 30, (1,), generator=gen)))
    grids = GRIDS[images]
    ids = torch.tensor(_prompt(grids, rng))
    if not grids:
        return ids, None, None
    grid_thw = torch.tensor(grids, dtype=torch.long)
    patch_dim = VISION["in_channels"] * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2
    return ids, torch.randn(int(grid_thw.prod(-1).sum()), patch_dim, generator=gen), grid_thw


def _transformers_logits(model, ids, pixel_values, grid_thw) -> torch.Tensor:
    kwargs = {}
    if pixel_values is not None:
        mm_token_type_ids = (ids == IMAGE).to(torch.int32)[None]  # what the processor returns with input_ids
        kwargs = dict(pixel_values=pixel_values, image_grid_thw=grid_thw, mm_token_type_ids=mm_token_type_ids)
    with torch.no_grad():
        return model(input_ids=ids[None], **kwargs).logits[0]


def _relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.parametrize("images", [0, 1, 3])
def test_logits_match_transformers(checkpoint, images: int) -> None:
    path, model = checkpoint
    ours_model = load_reference(path)
    ids, pixel_values, grid_thw = _inputs(images, seeded())
    expected = _transformers_logits(model, ids, pixel_values, grid_thw)
    logits = ours_model(ids, pixel_values, grid_thw)
    assert logits.shape == expected.shape == (len(ids), TEXT["vocab_size"])
    error = _relative(logits, expected)
    print(f"max relative error {error:.2e}")
    assert error < TOLERANCE
    assert int(logits[-1].argmax()) == int(expected[-1].argmax())  # the greedy next token


@pytest.mark.parametrize("checkpoint", ["moe"], indirect=True)  # the dense model has no stacked experts
def test_published_expert_layout_gives_the_same_logits(checkpoint, tmp_path) -> None:
    """Stacked experts stored transposed ([E, H, 2I], [E, I, H], as the published MoE checkpoints are)."""
    path, model = checkpoint
    assert read_config(path).moe
    tensors = load_file(path / "model.safetensors")
    swapped = {k: (v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v) for k, v in tensors.items()}
    assert any(swapped[k].shape != tensors[k].shape for k in tensors)
    save_file(swapped, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    ids, pixel_values, grid_thw = _inputs(1, seeded())
    expected = _transformers_logits(model, ids, pixel_values, grid_thw)
    assert _relative(load_reference(tmp_path)(ids, pixel_values, grid_thw), expected) < TOLERANCE
    reloaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path).eval()  # transformers reads it so too
    assert torch.equal(_transformers_logits(reloaded, ids, pixel_values, grid_thw), expected)


def test_sharded_checkpoint_reads_the_same(checkpoint, tmp_path) -> None:
    path, model = checkpoint
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids, pixel_values, grid_thw = _inputs(1, seeded())
    assert torch.equal(
        load_reference(tmp_path)(ids, pixel_values, grid_thw), load_reference(path)(ids, pixel_values, grid_thw)
    )


def _copy(path, tmp_path, edit_tensors=None, edit_config=None):
    tensors = load_file(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


NORM = "model.language_model.layers.1.input_layernorm.weight"


@pytest.mark.parametrize(
    ("edit_tensors", "edit_config", "message"),
    [
        (lambda t: t.pop(NORM), None, f"tensor {NORM} is missing"),
        (lambda t: t.update({NORM: torch.ones(7)}), None, f"tensor {NORM} has shape (7,)"),
        (lambda t: t.update({"model.language_model.extra.weight": torch.ones(2)}), None, "extra.weight"),
        (lambda t: t.update({"model.visual.extra": torch.ones(2)}), None, "model.visual.extra"),
        (lambda t: t.pop("model.visual.merger.norm.weight"), None, "model.visual.merger.norm.weight is missing"),
        (None, lambda c: c["text_config"].update(sliding_window=4), "sliding_window"),
        (None, lambda c: c["text_config"].update(new_key=1), "unknown key 'new_key'"),
        (None, lambda c: c["text_config"].update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (
            None,
            lambda c: c["text_config"].update(norm_topk_prob=False),
            "norm_topk_prob",
        ),  # MoE: refused; dense: unknown
        (None, lambda c: c["vision_config"].update(out_hidden_size=40), "out_hidden_size"),
        (None, lambda c: c["text_config"].pop("head_dim"), "head_dim is missing"),
        (None, lambda c: c.update(model_type="qwen2_vl"), "model_type 'qwen2_vl'"),
    ],
)
def test_bad_checkpoints_are_refused_by_name(checkpoint, tmp_path, edit_tensors, edit_config, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_reference(_copy(checkpoint[0], tmp_path, edit_tensors, edit_config))


def test_head_tying_follows_the_config(checkpoint, tmp_path) -> None:
    """Tied: lm_head may be absent, or a copy equal to the embeddings; untied: it is required."""
    path, _ = checkpoint
    tied = read_config(path).tie_word_embeddings
    if tied:
        embed = load_file(path / "model.safetensors")["model.language_model.embed_tokens.weight"]
        load_reference(_copy(path, tmp_path, lambda t: t.update({"lm_head.weight": embed.clone()})))
        with pytest.raises(ValueError, match="lm_head.weight differs"):
            load_reference(_copy(path, tmp_path, lambda t: t.update({"lm_head.weight": embed + 1})))
    else:
        with pytest.raises(ValueError, match="lm_head.weight is missing"):
            load_reference(_copy(path, tmp_path, lambda t: t.pop("lm_head.weight")))


def test_prompts_that_disagree_with_the_grids_are_refused(checkpoint) -> None:
    model = load_reference(checkpoint[0])
    ids, pixel_values, grid_thw = _inputs(1, seeded())
    with pytest.raises(ValueError, match="image 0"):
        model(ids[ids != IMAGE], pixel_values, grid_thw)  # the image's tokens left out
    with pytest.raises(ValueError, match="give both or neither"):
        model(ids, pixel_values, None)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.tensor([1, 2, 500]))


def test_attention_bias_and_sparse_step(tmp_path) -> None:
    """Other settings the published configs leave at their defaults: q/k/v/o biases, a MoE block
    every second layer (decoder_sparse_step 2)."""
    gen = seeded()
    text = dict(MOE_TEXT, attention_bias=True, decoder_sparse_step=2, mlp_only_layers=[])
    model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(vision_config=VISION, text_config=text, **IDS))
    randomize(model, gen)
    model.save_pretrained(tmp_path)
    ids, pixel_values, grid_thw = _inputs(3, gen)
    expected = _transformers_logits(model.eval(), ids, pixel_values, grid_thw)
    ours = load_reference(tmp_path)
    assert ours.config.text.attention_bias and [ours.config.text.is_sparse(i) for i in range(3)] == [False, True, False]
    assert _relative(ours(ids, pixel_values, grid_thw), expected) < TOLERANCE
