"""Multimodal rotary positions (M-RoPE) of Qwen3-VL's text model, as transformers 5.17 computes them.

Every token has three positions, (temporal, height, width):
- a text token has all three equal to the next text position, which starts at 0 and grows by one
  per text token;
- the tokens of one image (a run of image tokens, t * h * w / merge² of them, in the vision tower's
  merge-window order) take the grid positions (start + i_t, start + i_h, start + i_w) over the
  merged (t, h/merge, w/merge) grid, `start` being the next text position; after the image the
  next text position is start + max(h, w) / merge (transformers 5.17 advances by the spatial grid
  alone, whatever t; the processor's images all have t = 1);
- a video is cut into its frames (the processor writes "<1.5 seconds><vision_start><video
  tokens><vision_end>" per frame): each frame is a run of video tokens placed like an image of grid
  (1, h, w), the timestamps between frames being ordinary text.

A prompt's positions are computed once (`mrope_positions`, O(tokens) integer work) and kept with the
sequence. Tokens after the prompt (generated ones, decoded or re-prefilled after preemption) have
all three positions equal to index + delta, where delta = max(prompt positions) + 1 - len(prompt):
`MRopePositions.chunk(start, end)` gives any range of a sequence (chunked prefill slices the
prompt's positions, it does not recompute them), `decode_positions` a batch's new tokens.

`mrope_cos_sin` turns positions into the rotary cos / sin of Qwen3VLTextRotaryEmbedding: each
frequency takes its position from one of the three axes, interleaved as the checkpoint's
mrope_section says (config `MRopeConfig`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qruntime.shown import shown

IntSequence = Sequence[int] | torch.Tensor
Grids = Sequence[Sequence[int]] | torch.Tensor
Named = list[tuple[str, tuple[int, int, int]]]  # grids with the name errors give them ("image 2")


@dataclass(frozen=True)
class VisionTokenConfig:
    """The token ids that mark images and videos in a prompt and the vision tower's spatial merge.
    `vision_start_token_id`, when set, is checked to precede every image run and video frame."""

    image_token_id: int = 151655  # transformers' Qwen3VLConfig defaults, the published checkpoints' ids
    video_token_id: int | None = 151656
    vision_start_token_id: int | None = 151652
    spatial_merge_size: int = 2

    def __post_init__(self) -> None:
        for key in ("image_token_id", "video_token_id", "vision_start_token_id", "spatial_merge_size"):
            value = getattr(self, key)
            if value is None and key not in ("image_token_id", "spatial_merge_size"):
                continue
            low = 1 if key == "spatial_merge_size" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"vision token config: {key} must be an integer >= {low}, got {shown(value)}")
        ids = [self.image_token_id, self.video_token_id, self.vision_start_token_id]
        ids = [i for i in ids if i is not None]
        if len(set(ids)) != len(ids):
            raise ValueError(f"vision token config: image / video / vision_start token ids must differ, got {ids}")

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> VisionTokenConfig:
        """From a Qwen3-VL config.json (top-level token ids, vision_config.spatial_merge_size);
        missing keys take transformers' Qwen3VLConfig defaults."""
        vision = config.get("vision_config") or {}
        if not isinstance(vision, Mapping):
            raise ValueError(f"vision token config: vision_config must be a dict, got {shown(vision)}")
        fields = {k: config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id") if k in config}
        if "spatial_merge_size" in vision:
            fields["spatial_merge_size"] = vision["spatial_merge_size"]
        return cls(**fields)


@dataclass(frozen=True)
class MRopePositions:
    """One sequence's prompt positions [3, T] int64 (temporal, height, width) and its delta."""

    positions: torch.Tensor  # [3, T] int64
    delta: int  # max(positions) + 1 - T: what a token after the prompt adds to its index

    def chunk(self, start: int, end: int) -> torch.Tensor:
        """Positions [3, end - start] of the sequence's tokens [start, end): the prompt's slice, then
        index + delta for tokens past the prompt (generated tokens)."""
        if not 0 <= start <= end:
            raise ValueError(f"chunk [{start}, {end}) is not a range of token indices")
        prompt_len = self.positions.shape[1]
        head = self.positions[:, min(start, prompt_len) : min(end, prompt_len)]
        tail = torch.arange(max(start, prompt_len), max(end, prompt_len), device=self.positions.device) + self.delta
        return torch.cat([head, tail.expand(3, -1)], dim=1)


def _grid_rows(grids: Grids | None, what: str) -> list[tuple[int, int, int]]:
    """[N, 3] integer grids as python tuples, refused unless each is three integers."""
    if grids is None:
        return []
    if isinstance(grids, torch.Tensor):
        if grids.dtype.is_floating_point or grids.dtype.is_complex or grids.dtype == torch.bool:
            raise ValueError(f"{what}_grid_thw must hold integers, got dtype {grids.dtype}")
        if grids.ndim != 2 or grids.shape[1] != 3:
            raise ValueError(f"{what}_grid_thw must be [{what}s, 3], got shape {list(grids.shape)}")
        return [tuple(row) for row in grids.tolist()]
    rows = []
    for index, row in enumerate(grids):
        if len(row) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in row):
            raise ValueError(f"{what} {index}: grid_thw must be three integers (t, h, w), got {shown(row)}")
        rows.append(tuple(row))
    return rows


def _check_grid(name: str, grid: tuple[int, int, int], merge: int) -> None:
    if min(grid) < 1:
        raise ValueError(f"{name}: grid_thw {grid} has an entry below 1")
    for axis, side in (("h", grid[1]), ("w", grid[2])):
        if side % merge:
            raise ValueError(f"{name}: grid {axis}={side} is not a multiple of spatial_merge_size {merge}")


def _frames(videos: list[tuple[int, int, int]], merge: int) -> Named:
    """Each video's frames as grids (1, h, w), named for errors."""
    frames = []
    for index, grid in enumerate(videos):
        _check_grid(f"video {index}", grid, merge)
        frames += [(f"video {index} frame {f}", (1, grid[1], grid[2])) for f in range(grid[0])]
    return frames


@dataclass
class _Pending:
    """Grids in order of appearance and how many runs of tokens have taken one."""

    grids: Named
    cursor: int = 0


def _runs(types: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of equal token type: (type, start, end)."""
    change = (torch.nonzero(types[1:] != types[:-1]).flatten() + 1).tolist()
    starts, ends = [0, *change], [*change, types.numel()]
    return [(int(types[s]), s, e) for s, e in zip(starts, ends, strict=True)]


def _sequence_positions(
    ids: torch.Tensor,
    tokens: VisionTokenConfig,
    images: _Pending,
    frames: _Pending,
    where: str,
) -> torch.Tensor:
    """Positions [3, T] of one unpadded sequence, taking the next grids of `images` and `frames`
    (shared across a batch, in order of appearance)."""
    merge = tokens.spatial_merge_size
    types = torch.zeros_like(ids, dtype=torch.int8)  # 0 text, 1 image, 2 video
    types[ids == tokens.image_token_id] = 1
    if tokens.video_token_id is not None:
        types[ids == tokens.video_token_id] = 2
    parts, next_pos = [], 0
    for kind, start, end in _runs(types):
        if kind == 0:
            parts.append(torch.arange(next_pos, next_pos + end - start).expand(3, -1))
            next_pos += end - start
            continue
        pending, what = (images, "image") if kind == 1 else (frames, "video frame")
        if pending.cursor == len(pending.grids):
            raise ValueError(
                f"{what} {pending.cursor} ({where}, tokens {start}..{end - 1}) has no grid_thw: more runs of "
                f"{what} tokens than the {len(pending.grids)} grids"
            )
        name, (t, h, w) = pending.grids[pending.cursor]
        pending.cursor += 1
        if kind == 1:
            _check_grid(name, (t, h, w), merge)
        expected = t * h * w // (merge * merge)
        if end - start != expected:
            raise ValueError(
                f"{name}: {end - start} {what} tokens in a row ({where}, tokens {start}..{end - 1}) but its "
                f"grid_thw {(t, h, w)} with spatial_merge_size {merge} makes {expected} "
                "(consecutive images need other tokens between them)"
            )
        start_id = tokens.vision_start_token_id
        if start_id is not None and (start == 0 or int(ids[start - 1]) != start_id):
            raise ValueError(f"{name}: its tokens ({where}, from token {start}) do not follow vision_start {start_id}")
        gt, gh, gw = torch.meshgrid(torch.arange(t), torch.arange(h // merge), torch.arange(w // merge), indexing="ij")
        parts.append(torch.stack([gt, gh, gw]).reshape(3, -1) + next_pos)
        next_pos += max(h, w) // merge
    return torch.cat(parts, dim=1)


def _pending(
    image_grid_thw: Grids | None, video_grid_thw: Grids | None, tokens: VisionTokenConfig
) -> tuple[_Pending, _Pending]:
    """The images' and the video frames' grids, checked and named, none taken yet."""
    if video_grid_thw is not None and tokens.video_token_id is None:
        raise ValueError("video_grid_thw given but the vision token config has no video_token_id")
    images = [(f"image {i}", grid) for i, grid in enumerate(_grid_rows(image_grid_thw, "image"))]
    return _Pending(images), _Pending(_frames(_grid_rows(video_grid_thw, "video"), tokens.spatial_merge_size))


def _as_ids(input_ids: IntSequence, ndim: int) -> torch.Tensor:
    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(list(input_ids))
    if ids.ndim != ndim or ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty {ndim}-d sequence of token ids, got shape {list(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integers, got dtype {ids.dtype}")
    return ids.to("cpu", torch.long)


def _leftover(images: _Pending, frames: _Pending) -> None:
    for pending in (images, frames):
        if pending.cursor < len(pending.grids):
            name = pending.grids[pending.cursor][0]
            raise ValueError(f"{name}: its grid_thw has no run of tokens: more grids than runs in the prompt")


def mrope_positions(
    input_ids: IntSequence,
    tokens: VisionTokenConfig,
    image_grid_thw: Grids | None = None,
    video_grid_thw: Grids | None = None,
) -> MRopePositions:
    """One prompt's M-RoPE positions, as transformers' Qwen3VLModel.get_rope_index gives them.

    input_ids: [T] token ids (no padding); image_grid_thw: [images, 3] (t, h, w) in patches, one per
    image in the order the images appear (the preprocessing's `image_grid_thw`); video_grid_thw:
    [videos, 3] likewise. A ValueError names the image (or video frame) whose tokens and grid
    disagree: a run of image tokens per grid, each t * h * w / merge² long. Positions are int64 on
    the CPU (move them with the step's other host values)."""
    ids = _as_ids(input_ids, 1)
    images, frames = _pending(image_grid_thw, video_grid_thw, tokens)
    positions = _sequence_positions(ids, tokens, images, frames, "the prompt")
    _leftover(images, frames)
    return MRopePositions(positions, int(positions.max()) + 1 - ids.numel())


def batch_mrope_positions(
    input_ids: torch.Tensor,
    tokens: VisionTokenConfig,
    image_grid_thw: Grids | None = None,
    video_grid_thw: Grids | None = None,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded batch's positions [3, B, T] and deltas [B], as get_rope_index gives them: the grids
    are all the batch's images in order (sequence by sequence); tokens whose attention_mask is 0
    (padding, left or anywhere) are left out of the computation and get position 0."""
    ids = _as_ids(input_ids, 2)
    if attention_mask is None:
        mask = torch.ones_like(ids, dtype=torch.bool)
    else:
        if attention_mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {list(attention_mask.shape)} is not input_ids' {list(ids.shape)}")
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 and 1")
        mask = attention_mask.to("cpu").bool()
    images, frames = _pending(image_grid_thw, video_grid_thw, tokens)
    positions = torch.zeros(3, *ids.shape, dtype=torch.long)
    deltas = torch.zeros(ids.shape[0], dtype=torch.long)
    for b in range(ids.shape[0]):
        if not bool(mask[b].any()):
            raise ValueError(f"sequence {b} has no tokens: its attention_mask is all 0")
        seq = _sequence_positions(ids[b][mask[b]], tokens, images, frames, f"sequence {b}")
        positions[:, b, mask[b]] = seq
        deltas[b] = int(seq.max()) + 1 - seq.shape[1]
    _leftover(images, frames)
    return positions, deltas


def decode_positions(token_index: IntSequence, deltas: IntSequence) -> torch.Tensor:
    """Positions [3, B] of each sequence's next token after its prompt: its index in the sequence
    (the tokens before it) + the sequence's delta, equal on all three axes."""
    index = torch.as_tensor(token_index, dtype=torch.long).reshape(-1)
    delta = torch.as_tensor(deltas, dtype=torch.long, device=index.device).reshape(-1)
    if index.shape != delta.shape:
        raise ValueError(f"{index.numel()} token indices but {delta.numel()} deltas")
    return (index + delta).repeat(3, 1)


@dataclass(frozen=True)
class MRopeConfig:
    """The text model's rotary settings: head_dim, rope_theta and the interleaved mrope_section
    (frequencies per axis (t, h, w), summing to head_dim / 2)."""

    head_dim: int = 128
    rope_theta: float = 5_000_000.0
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    mrope_interleaved: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 2:
            raise ValueError(f"text config: head_dim must be an even integer >= 2, got {shown(self.head_dim)}")
        if self.head_dim % 2:
            raise ValueError(f"text config: head_dim must be even, got {self.head_dim}")
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 1:
            raise ValueError(f"text config: rope_theta must be a finite number above 1, got {shown(theta)}")
        section = self.mrope_section
        if isinstance(section, list):  # a config's JSON list; kept as a tuple so the config stays hashable
            object.__setattr__(self, "mrope_section", section := tuple(section))
        if (
            not isinstance(section, tuple)
            or len(section) != 3
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in section)
        ):
            raise ValueError(f"text config: mrope_section must be three positive integers (t, h, w), got {section}")
        half = self.head_dim // 2
        if sum(section) != half:
            raise ValueError(
                f"text config: mrope_section {list(section)} sums to {sum(section)}, not head_dim/2 = {half}"
            )
        if 3 * section[1] - 2 >= half or 3 * section[2] - 1 >= half:
            raise ValueError(
                f"text config: mrope_section {list(section)} cannot interleave in head_dim/2 = {half} "
                "frequencies (the h axis takes every third from 1, the w axis every third from 2)"
            )
        if self.mrope_interleaved is not True:
            raise ValueError(
                f"text config: mrope_interleaved {shown(self.mrope_interleaved)} is not supported: Qwen3-VL's "
                "sections interleave (transformers 5.17 interleaves whatever this key says; a false one is "
                "refused rather than guessed)"
            )

    @classmethod
    def from_dict(cls, text_config: Mapping[str, Any]) -> MRopeConfig:
        """From a Qwen3-VL config.json's text_config, read as transformers 5.17's Qwen3VLTextConfig
        reads it: `rope_parameters` (rope_type, rope_theta, mrope_section, mrope_interleaved), or the
        checkpoints' older spelling, `rope_scaling` plus a top-level `rope_theta`. Missing values take
        transformers' defaults (rope_theta 500000, mrope_section [24, 20, 20], head_dim 128); a
        rope_type other than "default" is refused, and so is a null head_dim (as transformers does)."""
        key = "rope_parameters" if text_config.get("rope_parameters") is not None else "rope_scaling"
        rope = text_config.get(key)
        rope = {} if rope is None else rope
        if not isinstance(rope, Mapping):
            raise ValueError(f"text config: {key} must be a dict, got {shown(rope)}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"text config: {key}.rope_type {shown(rope_type)} is not supported (only 'default')")
        theta = rope.get("rope_theta", text_config.get("rope_theta", 500_000.0))
        head_dim = text_config.get("head_dim", 128)
        section = rope.get("mrope_section", (24, 20, 20))
        if not isinstance(section, Sequence) or isinstance(section, str):
            raise ValueError(f"text config: {key}.mrope_section must be a list, got {shown(section)}")
        return cls(
            head_dim=head_dim,
            rope_theta=float(theta) if isinstance(theta, int) and not isinstance(theta, bool) else theta,
            mrope_section=tuple(section),
            mrope_interleaved=rope.get("mrope_interleaved", True),
        )

    def frequency_axes(self) -> list[int]:
        """The axis (0 t, 1 h, 2 w) each of the head_dim / 2 frequencies takes its position from:
        h at 1, 4, … (mrope_section[1] of them), w at 2, 5, … (mrope_section[2]), t elsewhere."""
        axes = [0] * (self.head_dim // 2)
        for axis in (1, 2):
            for j in range(self.mrope_section[axis]):
                axes[3 * j + axis] = axis
        return axes


def mrope_cos_sin(positions: torch.Tensor, config: MRopeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] (or [B, T, head_dim] for positions [3, B, T]) in float32, equal to
    transformers' Qwen3VLTextRotaryEmbedding: frequency i = 1 / theta^(2i / head_dim) times the
    position of its axis (`MRopeConfig.frequency_axes`), the head_dim/2 angles repeated twice.

    Applied as Qwen3's text rope is (rotate-half, NeoX): q' = q * cos + rotate_half(q) * sin, with
    rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2]); the same for k, after q_norm / k_norm."""
    if positions.ndim not in (2, 3) or positions.shape[0] != 3:
        raise ValueError(f"positions must be [3, T] or [3, B, T], got shape {list(positions.shape)}")
    device, d = positions.device, config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    axes = torch.tensor(config.frequency_axes(), device=device)
    chosen = positions.float()[axes]  # [d/2, T] or [d/2, B, T]: each frequency's position
    angles = chosen.movedim(0, -1) * inv_freq  # [..., T, d/2]
    emb = torch.cat([angles, angles], dim=-1)  # [..., T, d]
    return emb.cos(), emb.sin()
