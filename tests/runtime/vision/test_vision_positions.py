"""Qwen3-VL's multimodal rotary positions (qruntime.vision.positions) against transformers 5.17.

The references are a tiny random Qwen3VLModel's (and Qwen3VLMoeModel's) `get_rope_index` and
`compute_3d_position_ids`, and Qwen3VLTextRotaryEmbedding (and the MoE's). Prompts are random (fresh
seed per test, printed by the `rng` fixture): text with 0, 1 or 3 images of different grids, videos
cut into timestamped frames, batches with left padding. transformers' token types come from its
processor's own `create_mm_token_type_ids` (image token 1, video token 2).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from qruntime.vision.positions import (
    MRopeConfig,
    MRopePositions,
    VisionTokenConfig,
    batch_mrope_positions,
    decode_positions,
    mrope_cos_sin,
    mrope_positions,
)
from transformers import ProcessorMixin, Qwen3VLConfig, Qwen3VLModel, Qwen3VLMoeConfig, Qwen3VLMoeModel
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextRotaryEmbedding

IMAGE, VIDEO, START, END, PAD = 190, 191, 192, 193, 194  # a tiny vocabulary's special ids
TEXT_IDS = range(0, 180)
TEXT = dict(
    vocab_size=200,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 1, 1], mrope_interleaved=True),
)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16, patch_size=4)
VISION |= dict(deepstack_visual_indexes=[0], num_position_embeddings=16)
PROCESSOR = SimpleNamespace(image_token_ids=[IMAGE], video_token_ids=[VIDEO], audio_token_ids=[])
IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)


@pytest.fixture(scope="module", params=["dense", "moe"])
def hf_model(request: pytest.FixtureRequest) -> Qwen3VLModel:
    """A tiny random Qwen3-VL model (its weights unused: only its position code runs)."""
    torch.manual_seed(0)
    if request.param == "dense":
        return Qwen3VLModel(Qwen3VLConfig(text_config=TEXT, vision_config=VISION, **IDS))
    moe_text = dict(TEXT, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8, decoder_sparse_step=1)
    return Qwen3VLMoeModel(Qwen3VLMoeConfig(text_config=moe_text, vision_config=VISION, **IDS))


def tokens_for(merge: int) -> VisionTokenConfig:
    return VisionTokenConfig(
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, spatial_merge_size=merge
    )


def random_grid(rng: random.Random, merge: int, t: int = 1) -> list[int]:
    return [t, merge * rng.randint(1, 5), merge * rng.randint(1, 5)]


def random_prompt(
    rng: random.Random, merge: int, images: int, videos: int = 0
) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """Text, then images and videos in random order with text between them: (ids, image grids, video grids)."""
    items = ["image"] * images + ["video"] * videos
    rng.shuffle(items)
    ids = [rng.choice(TEXT_IDS) for _ in range(rng.randint(1, 6))]
    image_grids, video_grids = [], []
    for item in items:
        if item == "image":  # the processor's images have t = 1; transformers places t > 1 too
            grid = random_grid(rng, merge, t=rng.choice([1, 1, 1, 2]))
            image_grids.append(grid)
            ids += [START] + [IMAGE] * (grid[0] * grid[1] * grid[2] // merge**2) + [END]
        else:
            grid = random_grid(rng, merge, t=rng.randint(1, 3))
            video_grids.append(grid)
            for _ in range(grid[0]):  # "<t seconds>" text, then the frame
                ids += [rng.choice(TEXT_IDS) for _ in range(rng.randint(1, 4))]
                ids += [START] + [VIDEO] * (grid[1] * grid[2] // merge**2) + [END]
        ids += [rng.choice(TEXT_IDS) for _ in range(rng.randint(1, 6))]
    return ids, image_grids, video_grids


def hf_rope_index(model, ids: torch.Tensor, merge: int, images, videos, mask=None):
    """transformers' positions [3, B, T] and deltas [B] for a batch."""
    model.config.vision_config.spatial_merge_size = merge
    types = torch.tensor(ProcessorMixin.create_mm_token_type_ids(PROCESSOR, ids))  # the processor's types
    grid = lambda g: torch.tensor(g, dtype=torch.long).reshape(-1, 3) if g else None  # noqa: E731
    positions, deltas = model.get_rope_index(ids, types, grid(images), grid(videos), attention_mask=mask)
    return positions, deltas.reshape(-1)


@pytest.mark.parametrize("images", [0, 1, 3])
@pytest.mark.parametrize("merge", [2, 3])
def test_prompt_positions_equal_transformers(hf_model, rng: random.Random, images: int, merge: int) -> None:
    for _ in range(20):
        ids, image_grids, video_grids = random_prompt(rng, merge, images, videos=rng.choice([0, 0, 1]))
        ours = mrope_positions(ids, tokens_for(merge), image_grids or None, video_grids or None)
        hf_positions, hf_deltas = hf_rope_index(hf_model, torch.tensor([ids]), merge, image_grids, video_grids)
        assert torch.equal(ours.positions, hf_positions[:, 0]), (ids, image_grids, video_grids)
        assert ours.delta == int(hf_deltas[0])
        if not images and not video_grids:  # text alone: 0 .. T-1 on every axis
            assert torch.equal(ours.positions, torch.arange(len(ids)).expand(3, -1)) and ours.delta == 0


def test_left_padded_batch_equals_transformers(hf_model, rng: random.Random) -> None:
    merge = 2
    for _ in range(5):
        prompts = [random_prompt(rng, merge, rng.choice([0, 1, 3]), rng.choice([0, 1])) for _ in range(4)]
        width = max(len(p[0]) for p in prompts) + rng.randint(0, 3)
        ids = torch.tensor([[PAD] * (width - len(p[0])) + p[0] for p in prompts])
        mask = torch.tensor([[0] * (width - len(p[0])) + [1] * len(p[0]) for p in prompts])
        images = [g for p in prompts for g in p[1]]
        videos = [g for p in prompts for g in p[2]]
        positions, deltas = batch_mrope_positions(ids, tokens_for(merge), images or None, videos or None, mask)
        hf_positions, hf_deltas = hf_rope_index(hf_model, ids, merge, images, videos, mask)
        assert torch.equal(positions, hf_positions) and torch.equal(deltas, hf_deltas)
        for b, (prompt, *_) in enumerate(prompts):  # each row is its unpadded prompt's positions
            alone = mrope_positions(prompt, tokens_for(merge), prompts[b][1] or None, prompts[b][2] or None)
            assert torch.equal(positions[:, b, width - len(prompt) :], alone.positions)
            assert alone.delta == int(deltas[b])


class _Cache:
    """What compute_3d_position_ids asks of a KV cache: how many tokens it holds."""

    def __init__(self, length: int) -> None:
        self.length = length

    def get_seq_length(self) -> int:
        return self.length


def test_decode_and_chunk_positions_equal_transformers(hf_model, rng: random.Random) -> None:
    merge = 2
    ids, image_grids, _ = random_prompt(rng, merge, images=3)
    ours = mrope_positions(ids, tokens_for(merge), image_grids)
    hf_model.rope_deltas = torch.tensor([[ours.delta]])
    prompt_len, steps = len(ids), 5
    for past in range(prompt_len, prompt_len + steps):  # transformers' decode: one new token on a cache of `past`
        embeds = torch.zeros(1, 1, 16)
        hf = hf_model.compute_3d_position_ids(None, embeds, past_key_values=_Cache(past))
        assert torch.equal(decode_positions([past], [ours.delta]), hf[:, 0])
        assert torch.equal(ours.chunk(past, past + 1), hf[:, 0])
    hf_model.rope_deltas = None
    full = ours.chunk(0, prompt_len + steps)
    assert torch.equal(full[:, :prompt_len], ours.positions)
    cuts = sorted(rng.sample(range(1, prompt_len + steps), 3))
    pieces = [ours.chunk(a, b) for a, b in zip([0, *cuts], [*cuts, prompt_len + steps], strict=True)]
    assert torch.equal(torch.cat(pieces, dim=1), full)  # chunked prefill: slices of one computation
    batch = decode_positions(torch.tensor([7, 40]), torch.tensor([-3, 2]))
    assert torch.equal(batch, torch.tensor([[4, 42]] * 3))


def hf_rotary(config_cls, rotary_cls, head_dim: int, theta: float, section: list[int]):
    rope = dict(rope_type="default", rope_theta=theta, mrope_section=section, mrope_interleaved=True)
    text = config_cls(**dict(TEXT, head_dim=head_dim, rope_parameters=rope))
    return text, rotary_cls(text)


ROPES = [(128, 5_000_000.0, [24, 20, 20]), (64, 1_000_000.0, [16, 8, 8]), (8, 10_000.0, [2, 1, 1])]


@pytest.mark.parametrize("head_dim, theta, section", ROPES)
@pytest.mark.parametrize("moe", [False, True])
def test_cos_sin_equal_transformers(rng: random.Random, moe: bool, head_dim: int, theta: float, section) -> None:
    classes = (
        (Qwen3VLMoeTextConfig, Qwen3VLMoeTextRotaryEmbedding)
        if moe
        else (Qwen3VLTextConfig, Qwen3VLTextRotaryEmbedding)
    )
    text, rotary = hf_rotary(*classes, head_dim, theta, section)
    config = MRopeConfig.from_dict(text.to_dict())
    assert config == MRopeConfig(head_dim, theta, tuple(section))
    prompts = [random_prompt(rng, 2, images=3) for _ in range(2)]
    width = max(len(p[0]) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p[0])) + p[0] for p in prompts])
    mask = (ids != PAD).long()
    images = [g for p in prompts for g in p[1]]
    positions, _ = batch_mrope_positions(ids, tokens_for(2), images, attention_mask=mask)  # [3, 2, T]
    far = torch.tensor([rng.randrange(200_000) for _ in range(3 * 64)]).reshape(3, 1, 64)  # long contexts
    for pos in (positions, far):
        hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
        cos, sin = mrope_cos_sin(pos, config)
        assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (*pos.shape[1:], head_dim)
        torch.testing.assert_close(cos, hf_cos, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin, hf_sin, rtol=1e-6, atol=1e-6)
        cos0, sin0 = mrope_cos_sin(pos[:, 0], config)  # unbatched [3, T] -> [T, head_dim]
        assert torch.equal(cos0, cos[0]) and torch.equal(sin0, sin[0])


def test_mrope_config_reads_both_spellings() -> None:
    """The published checkpoints' text_config spells it rope_scaling + rope_theta; transformers 5.17
    stores rope_parameters. Both read alike, and alike to what transformers makes of them."""
    legacy = dict(
        head_dim=128,
        rope_theta=5_000_000,
        rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
    )
    ours = MRopeConfig.from_dict(legacy)
    assert ours == MRopeConfig(128, 5_000_000.0, (24, 20, 20), True)
    assert MRopeConfig.from_dict(Qwen3VLTextConfig(**legacy).to_dict()) == ours
    assert MRopeConfig.from_dict({}) == MRopeConfig(128, 500_000.0, (24, 20, 20), True)  # transformers' defaults
    assert MRopeConfig(64, 5e6, [24, 4, 4]).mrope_section == (24, 4, 4)  # a JSON list kept as a tuple
    tokens = VisionTokenConfig.from_dict(Qwen3VLConfig(vision_config=dict(spatial_merge_size=3)).to_dict())
    assert tokens == VisionTokenConfig(151655, 151656, 151652, 3)


@pytest.mark.parametrize(
    "text_config, key",
    [
        ({"head_dim": 128, "rope_parameters": {"mrope_section": [24, 20, 21]}}, "sums to 65, not head_dim/2 = 64"),
        ({"head_dim": 128, "rope_parameters": {"mrope_section": [32, 32]}}, "mrope_section"),
        ({"head_dim": 128, "rope_parameters": {"mrope_section": [64, 0, 0]}}, "mrope_section"),
        ({"head_dim": 24, "rope_parameters": {"mrope_section": [2, 5, 5]}}, "cannot interleave"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters.rope_type"),
        ({"rope_scaling": {"type": "dynamic"}}, "rope_scaling.rope_type"),
        ({"rope_parameters": {"mrope_interleaved": False}}, "mrope_interleaved"),
        ({"rope_parameters": {"rope_theta": -1.0}}, "rope_theta"),
        ({"rope_theta": float("nan")}, "rope_theta"),
        ({"head_dim": 127}, "head_dim"),
        ({"head_dim": None, "hidden_size": 2048, "num_attention_heads": 16}, "head_dim must be"),
        ({"rope_parameters": "default"}, "rope_parameters must be a dict"),
        ({"rope_parameters": {"mrope_section": "24,20,20"}}, "mrope_section must be a list"),
    ],
)
def test_mrope_config_refusals_name_the_key(text_config: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.").replace("(", r"\(")):
        MRopeConfig.from_dict(text_config)


def _image(grid: list[int], merge: int = 2) -> list[int]:
    return [START] + [IMAGE] * (grid[0] * grid[1] * grid[2] // merge**2) + [END]


@pytest.mark.parametrize(
    "ids, images, videos, message",
    [
        (
            [1, *_image([1, 2, 2]), 2, *_image([1, 4, 2]), 3],
            [[1, 2, 2]],
            None,
            r"image 1 \(the prompt, tokens 6..7\) has no grid_thw: more runs of image tokens than the 1 grids",
        ),
        ([1, *_image([1, 2, 2]), 3], [[1, 2, 2], [1, 4, 4]], None, "image 1: its grid_thw has no run of tokens"),
        ([1, *_image([1, 2, 2]), 2, *_image([1, 4, 2]), 3], [[1, 2, 2], [1, 4, 4]], None, "image 1: 2 image tokens"),
        ([1, *_image([1, 2, 2]), 2, *_image([1, 4, 2]), 3], [[1, 2, 2], [1, 0, 4]], None, r"image 1: grid_thw \(1, 0"),
        ([1, *_image([1, 2, 2]), 2, *_image([1, 4, 2]), 3], [[1, 2, 2], [-1, 4, 2]], None, "image 1: .* below 1"),
        ([1, *_image([1, 2, 2]), 2, *_image([1, 4, 2]), 3], [[1, 2, 2], [1, 4, 3]], None, "image 1: grid w=3"),
        ([1, IMAGE, IMAGE, 2], [[1, 2, 4]], None, "image 0: its tokens .* do not follow vision_start"),
        ([1, START, IMAGE, IMAGE, END], [[1, 2, 2], [1, 2, 2]], None, "image 0: 2 image tokens .* need other"),
        ([*_image([1, 2, 2])], [[1, 2]], None, "image 0: grid_thw must be three integers"),
        ([*_image([1, 2, 2])], [[1.0, 2, 2]], None, "image 0: grid_thw must be three integers"),
        ([1, START, VIDEO, END, 5, START, VIDEO, END], None, [[3, 2, 2]], "video 0 frame 2: its grid_thw has no run"),
        ([1, START, VIDEO, VIDEO, END], None, [[1, 2, 2]], "video 0 frame 0: 2 video frame tokens"),
        ([1, START, VIDEO, END], None, None, "video frame 0 .* has no grid_thw"),
    ],
)
def test_mismatched_prompts_name_the_image(ids, images, videos, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mrope_positions(ids, tokens_for(2), images, videos)


def test_bad_inputs_are_refused() -> None:
    tokens = tokens_for(2)
    grids = torch.tensor([[1, 2, 2]])
    with pytest.raises(ValueError, match=r"image_grid_thw must be \[images, 3\]"):
        mrope_positions(_image([1, 2, 2]), tokens, torch.tensor([1, 2, 2]))
    with pytest.raises(ValueError, match="image_grid_thw must hold integers"):
        mrope_positions(_image([1, 2, 2]), tokens, grids.float())
    with pytest.raises(ValueError, match="non-empty 1-d"):
        mrope_positions([], tokens)
    with pytest.raises(ValueError, match="input_ids must hold integers"):
        mrope_positions(torch.tensor([1.0, 2.0]), tokens)
    with pytest.raises(ValueError, match="input_ids must hold integers"):
        mrope_positions([1, 2.5], tokens)
    batch = torch.tensor([[PAD, *_image([1, 2, 2])], [PAD, 5, 6, 7]])
    with pytest.raises(ValueError, match="attention_mask shape"):
        batch_mrope_positions(batch, tokens, grids, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="only 0 and 1"):
        batch_mrope_positions(batch, tokens, grids, attention_mask=torch.full((2, 4), 2))
    with pytest.raises(ValueError, match="sequence 1 has no tokens"):
        batch_mrope_positions(batch, tokens, grids, attention_mask=torch.tensor([[0, 1, 1, 1], [0] * 4]))
    with pytest.raises(
        ValueError, match=r"image 1 \(sequence 1, tokens 1..1\) has no grid_thw"
    ):  # the grid went to sequence 0
        batch_mrope_positions(torch.tensor([[*_image([1, 2, 2])], [*_image([1, 2, 2])]]), tokens, grids)
    with pytest.raises(ValueError, match="no video_token_id"):
        mrope_positions([1, 2], VisionTokenConfig(IMAGE, None, START, 2), video_grid_thw=[[1, 2, 2]])
    with pytest.raises(ValueError, match="spatial_merge_size"):
        VisionTokenConfig(IMAGE, VIDEO, START, 0)
    with pytest.raises(ValueError, match="must differ"):
        VisionTokenConfig(IMAGE, IMAGE, START, 2)
    with pytest.raises(ValueError, match="is not a range"):
        MRopePositions(torch.zeros(3, 4, dtype=torch.long), 0).chunk(3, 2)
    with pytest.raises(ValueError, match="2 token indices but 1 deltas"):
        decode_positions([4, 5], [0])
    with pytest.raises(ValueError, match=r"positions must be \[3, T\]"):
        mrope_cos_sin(torch.zeros(4, 8, dtype=torch.long), MRopeConfig())


def test_text_after_image_continues_from_the_larger_side() -> None:
    """A worked example: a 1 x 4 x 8 grid (merge 2: 2 x 4 tokens) after two text tokens."""
    ids = [7, START, *[IMAGE] * 8, END, 9]
    result = mrope_positions(ids, tokens_for(2), [[1, 4, 8]])
    expected = torch.tensor(
        [
            [0, 1, 2, 2, 2, 2, 2, 2, 2, 2, 6, 7],
            [0, 1, 2, 2, 2, 2, 3, 3, 3, 3, 6, 7],
            [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 6, 7],
        ]
    )
    assert torch.equal(result.positions, expected) and result.delta == 8 - 12


def test_vision_start_check_is_optional_and_ids_may_be_any_integer_tensor() -> None:
    ids = [7, IMAGE, IMAGE, 9]
    unchecked = VisionTokenConfig(IMAGE, VIDEO, None, 2)
    result = mrope_positions(
        torch.tensor(ids, dtype=torch.int32), unchecked, torch.tensor([[1, 2, 4]], dtype=torch.int32)
    )
    assert torch.equal(result.positions, torch.tensor([[0, 1, 1, 3], [0, 1, 1, 3], [0, 1, 2, 3]]))
    assert result.positions.dtype == torch.int64 and result.delta == 0
