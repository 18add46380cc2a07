"""The engine's Qwen3-VL step plumbing on the host (engine/multimodal.py, StepChunk, ModelRunner.prepare,
DecodeInputs, the prefix cache's hash chain): a request's chunks carry exactly its prompt's M-RoPE
positions and its image rows, the encoder runs once for all pending requests, a step's feeds put
them at the right rows, and cached blocks are named by the images' pixels too. Random prompts
(fresh seed per test, printed by the `rng` fixture)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from qruntime.engine.decode_inputs import DecodeInputs
from qruntime.engine.model_runner import ModelRunner
from qruntime.engine.multimodal import (
    VisionModel,
    encode_pending,
    image_digest,
    request_images,
)
from qruntime.engine.prefix_cache import extend_chain
from qruntime.engine.step_chunk import StepChunk
from qruntime.vision.positions import VisionTokenConfig, mrope_positions
from qruntime.vision.preprocess import QWEN3_VL, VisionInputs

IMAGE, START, END = 190, 192, 193
TOKENS = VisionTokenConfig(image_token_id=IMAGE, video_token_id=191, vision_start_token_id=START, spatial_merge_size=2)
PATCH_DIM = 12  # any width: the encoder below does not read the pixels' meaning
WIDTH = 6  # (1 + D) * H of a fake model


def random_prompt(rng: random.Random, images: int) -> tuple[list[int], VisionInputs | None]:
    """Text with `images` images of random grids (one of two frames), expanded."""
    ids, grids = [rng.randrange(180) for _ in range(rng.randint(1, 7))], []
    for _ in range(images):
        grid = [rng.choice([1, 2]), 2 * rng.randint(1, 3), 2 * rng.randint(1, 3)]
        grids.append(grid)
        ids += [START] + [IMAGE] * (grid[0] * grid[1] * grid[2] // 4) + [END]
        ids += [rng.randrange(180) for _ in range(rng.randint(0, 5))]
    if not images:
        return ids, None
    patches = sum(t * h * w for t, h, w in grids)
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    pixels = torch.randn(patches, PATCH_DIM, generator=generator)
    return ids, VisionInputs(pixels, torch.tensor(grids, dtype=torch.int64))


def fake_encoder(calls: list[int]):
    """An 'encoder' whose row for a patch window is a function of its pixels alone: [tokens, WIDTH]."""

    def encode(pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        calls.append(int(grids.shape[0]))
        return pixels.view(-1, 4 * PATCH_DIM)[:, :WIDTH] * 2 + 1  # 4 patches (merge 2 x 2) per token

    return encode


def model(calls: list[int]) -> VisionModel:
    return VisionModel(fake_encoder(calls), TOKENS, QWEN3_VL, WIDTH)


@pytest.mark.parametrize("images", [1, 3])
def test_chunks_carry_the_prompts_positions_and_image_rows(rng, images):
    ids, vision = random_prompt(rng, images)
    state = request_images(ids, vision, TOKENS)
    want = mrope_positions(ids, TOKENS, vision.image_grid_thw)
    assert np.array_equal(state.positions, want.positions.numpy()) and state.delta == want.delta
    assert state.rows.tolist() == [i for i, t in enumerate(ids) if t == IMAGE]
    encode_pending([state], model([]), torch.device("cpu"))
    generated = rng.randint(1, 6)
    total = len(ids) + generated
    cuts = sorted({0, total, *rng.sample(range(1, total), min(4, total - 1))})
    rows_seen, embeds_seen = [], []
    for start, end in zip(cuts, cuts[1:], strict=False):  # chunked prefill, then decode tokens
        mrope, rows, embeds = state.chunk_parts(start, end)
        whole = want.chunk(start, end)  # the prompt's slice, then index + delta past it
        assert np.array_equal(np.array(mrope), whole.numpy()), (start, end)
        rows_seen += [start + r for r in rows]
        if rows:
            embeds_seen.append(embeds)
        else:
            assert embeds is None
    assert rows_seen == state.rows.tolist()
    assert torch.equal(torch.cat(embeds_seen), state.embeds)


def test_the_encoder_runs_once_for_every_pending_request(rng):
    prompts = [random_prompt(rng, n) for n in (1, 3, 2)]
    states = [request_images(ids, vision, TOKENS) for ids, vision in prompts]
    calls: list[int] = []
    encode_pending(states, model(calls), torch.device("cpu"))
    assert calls == [6]  # one call, every image of the three requests
    for (_, vision), state in zip(prompts, states, strict=True):
        alone: list[int] = []
        expected = fake_encoder(alone)(vision.pixel_values, vision.image_grid_thw)
        assert torch.equal(state.embeds, expected) and state.inputs is None
        assert not state.needs_encoder(0, 10**6)
    encode_pending(states, model(calls), torch.device("cpu"))  # nothing left to encode
    assert calls == [6]


def test_needs_encoder_only_when_a_chunk_reaches_an_image_token(rng):
    ids, vision = random_prompt(rng, 1)
    state = request_images(ids, vision, TOKENS)
    first, last = int(state.rows[0]), int(state.rows[-1])
    assert not state.needs_encoder(0, first)
    assert state.needs_encoder(first, first + 1) and state.needs_encoder(last, last + 1)
    assert not state.needs_encoder(last + 1, len(ids) + 3)
    with pytest.raises(ValueError, match="encode_pending"):
        state.chunk_parts(first, first + 1)


def test_a_prompt_whose_image_runs_disagree_with_the_grids_is_refused(rng):
    ids, vision = random_prompt(rng, 2)
    at = ids.index(IMAGE)
    with pytest.raises(ValueError, match="image"):
        request_images(ids[:at] + ids[at + 1 :], vision, TOKENS)  # the first run one token short


def feeds_of(chunks: list[StepChunk], mrope: bool, vision: bool):
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size, runner.device, runner.max_context_len = 4, torch.device("cpu"), 64
    runner.mrope, runner.vision = mrope, ((WIDTH, torch.float32) if vision else None)
    return runner.prepare(chunks)[0]


def test_a_steps_feeds_put_positions_and_image_rows_at_their_rows(rng):
    prompts = [random_prompt(rng, n) for n in (0, 2, 1)]
    states = [request_images(ids, v, TOKENS) if v is not None else None for ids, v in prompts]
    encode_pending([s for s in states if s is not None], model([]), torch.device("cpu"))
    chunks, want_pos, want_rows, want_embeds, offset = [], [], [], [], 0
    for (ids, _), state in zip(prompts, states, strict=True):
        start = rng.randrange(len(ids))
        end = rng.randint(start + 1, len(ids))
        table = tuple(range(-(-end // 4)))
        if state is None:
            chunks.append(StepChunk(tuple(ids[start:end]), start, table))
            want_pos.append(np.repeat(np.arange(start, end)[None], 3, axis=0))
        else:
            chunks.append(
                StepChunk.of(
                    SimpleNamespace(
                        request=SimpleNamespace(request_id="r", prompt_token_ids=ids, output_token_ids=[]),
                        start=start,
                        num_tokens=end - start,
                        draft=(),
                        block_table=table,
                    ),
                    images=state,
                )
            )
            want_pos.append(state.positions[:, start:end])
            inside = [r for r in state.rows.tolist() if start <= r < end]
            want_rows += [offset + r - start for r in inside]
            if inside:
                lo = state.rows.tolist().index(inside[0])
                want_embeds.append(state.embeds[lo : lo + len(inside)])
        offset += end - start
    feeds = feeds_of(chunks, mrope=True, vision=True)
    assert torch.equal(feeds["positions"], torch.from_numpy(np.concatenate(want_pos, axis=1)))
    assert feeds["vision_rows"].shape == (len(want_rows), 1) and feeds["vision_rows"][:, 0].tolist() == want_rows
    embeds = torch.cat(want_embeds) if want_embeds else torch.zeros(0, WIDTH)
    assert torch.equal(feeds["vision_embeds"], embeds)
    text = feeds_of([chunks[0]], mrope=False, vision=False)  # a Qwen3 graph's feeds: as before
    assert text["positions"].shape == (chunks[0].num_tokens,) and "vision_rows" not in text


def test_decode_inputs_write_three_position_rows():
    inputs = DecodeInputs(4, 3, 4, 9, pin=False, mrope=True)
    chunks = [StepChunk((5,), 6, (1, 2)), StepChunk((7,), 2, (3,), mrope=((10,), (11,), (12,)))]
    inputs.fill(chunks, 4)
    assert inputs.tensors["positions"].tolist() == [[6, 10, 0, 0], [6, 11, 0, 0], [6, 12, 0, 0]]
    assert inputs.tensors["slot_mapping"].tolist()[:2] == [2 * 4 + 2, 3 * 4 + 2]  # slots from `start`
    assert inputs.tensors["input_ids"].tolist()[:2] == [5, 7]


def test_cached_blocks_are_named_by_the_images_pixels(rng):
    ids, vision = random_prompt(rng, 2)
    ids += [rng.randrange(180) for _ in range(12)]
    state = request_images(ids, vision, TOKENS)
    other = VisionInputs(vision.pixel_values.clone(), vision.image_grid_thw)
    other.pixel_values[-1, 0] += 1.0  # the second image differs in one value
    changed = request_images(ids, other, TOKENS)
    assert changed.keys[0] == state.keys[0] and changed.keys[1] != state.keys[1]
    bs, salt = 4, b"s" * 32
    one = extend_chain([], salt, ids, bs, state.keys)
    two = extend_chain([], salt, ids, bs, changed.keys)
    second = state.keys[1][0] // bs  # the block holding the second image's first token
    assert one[:second] == two[:second] and all(a != b for a, b in zip(one[second:], two[second:], strict=True))
    text = extend_chain([], salt, ids, bs)
    assert text[: state.keys[0][0] // bs] == one[: state.keys[0][0] // bs] and text[-1] != one[-1]
    split = rng.randrange(1, len(ids) // bs)  # extended in two calls: the same chain
    part = extend_chain([], salt, ids[: split * bs], bs, state.keys)
    assert extend_chain(part, salt, ids[split * bs :], bs, state.keys) == one


def test_image_digest_sees_pixels_grid_and_dtype(rng):
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    pixels = torch.randn(8, PATCH_DIM, generator=generator)
    base = image_digest(pixels, (2, 2, 2))
    assert image_digest(pixels.clone(), (2, 2, 2)) == base
    assert image_digest(pixels, (1, 2, 4)) != base
    assert image_digest(pixels.double(), (2, 2, 2)) != base


def test_keys_come_from_given_digests_or_none_without_the_prefix_cache(rng):
    ids, vision = random_prompt(rng, 2)
    given = [bytes([i]) * 32 for i in range(2)]
    state = request_images(ids, vision, TOKENS, given)
    assert [digest for _, digest in state.keys] == given
    assert request_images(ids, vision, TOKENS, keyed=False).keys == ()
    with pytest.raises(ValueError, match="digests"):
        request_images(ids, vision, TOKENS, given[:1])


def test_keys_default_to_the_inputs_digests(rng):
    ids, vision = random_prompt(rng, 2)
    given = (b"a" * 32, b"b" * 32)
    state = request_images(ids, VisionInputs(vision.pixel_values, vision.image_grid_thw, given), TOKENS)
    assert tuple(digest for _, digest in state.keys) == given
