"""What the vision tower derives from `image_grid_thw` alone: each patch's (row, col) in its frame,
the learned position embedding resampled to each image's grid, and the 2-D rotary's cos / sin.

Patches arrive in merge-window order (preprocess.patchify): per frame, the m x m windows row by row,
and inside a window its m x m patches row by row. Every function here follows that order.
"""

from __future__ import annotations

import torch

from qruntime.shown import shown


def grid_list(grid_thw: torch.Tensor, patches: int, merge: int) -> list[tuple[int, int, int]]:
    """`grid_thw` [images, 3] checked against the patch count and the merge size, as Python ints."""
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or grid_thw.shape[0] == 0:
        raise ValueError(f"image_grid_thw must be [images, 3], got shape {tuple(grid_thw.shape)}")
    if grid_thw.dtype.is_floating_point or grid_thw.dtype.is_complex or grid_thw.dtype == torch.bool:
        raise ValueError(f"image_grid_thw must hold integers, got {grid_thw.dtype}")
    grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
    for i, (t, h, w) in enumerate(grids):
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ValueError(
                f"image_grid_thw[{i}] = {shown((t, h, w))}: t, h, w must be positive, h and w multiples of "
                f"spatial_merge_size ({merge})"
            )
    total = sum(t * h * w for t, h, w in grids)
    if total != patches:
        raise ValueError(f"image_grid_thw covers {total} patches, but pixel_values has {patches} rows")
    return grids


def patch_coords(
    grids: list[tuple[int, int, int]], merge: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, col, height, width) per patch, each [patches] int64: the patch's place in its frame and
    its image's grid size, in merge-window order, the same rows for every frame of an image."""
    rows, cols, heights, widths = [], [], [], []
    for t, h, w in grids:
        # window (wr, wc) and place in window (ir, ic) → row wr*m + ir, col wc*m + ic
        wr = torch.arange(h // merge, device=device)[:, None, None, None]
        wc = torch.arange(w // merge, device=device)[None, :, None, None]
        ir = torch.arange(merge, device=device)[None, None, :, None]
        ic = torch.arange(merge, device=device)[None, None, None, :]
        shape = (h // merge, w // merge, merge, merge)
        row = (wr * merge + ir).expand(shape).reshape(-1)
        col = (wc * merge + ic).expand(shape).reshape(-1)
        rows.append(row.repeat(t))
        cols.append(col.repeat(t))
        heights.append(torch.full((t * h * w,), h, device=device))
        widths.append(torch.full((t * h * w,), w, device=device))
    return torch.cat(rows), torch.cat(cols), torch.cat(heights), torch.cat(widths)


def _bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Along one axis: the two source positions of `side` that `index` (of `size`) reads and their
    weights, for a bilinear resize with align_corners=True (ends map to ends)."""
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)  # [N] in [0, side-1]
    low = torch.floor(src)
    taps = low.long()[:, None] + torch.arange(2, device=index.device)  # [N, 2]: low, low + 1
    weights = (1 - (src[:, None] - taps.to(torch.float32)).abs()).clamp(min=0)  # [N, 2]
    return taps.clamp(0, side - 1), weights


def position_embeddings(
    table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, heights: torch.Tensor, widths: torch.Tensor
) -> torch.Tensor:
    """The side x side learned grid `table` [side*side, hidden], resampled bilinearly
    (align_corners=True) to each patch's image grid and read at its (row, col): [patches, hidden]
    float32 (the four taps weighted in float32, as transformers does)."""
    side = round(table.shape[0] ** 0.5)
    index, weight = position_taps(rows, cols, heights, widths, side)  # [N, 4] each
    return (table[index] * weight[:, :, None]).sum(dim=1)  # [N, hidden]


def position_taps(
    rows: torch.Tensor, cols: torch.Tensor, heights: torch.Tensor, widths: torch.Tensor, side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The four bilinear taps (align_corners=True) of each patch into the side x side position grid:
    (index [patches, 4] int64 rows of the flattened grid, weight [patches, 4] float32)."""
    row_taps, row_weights = _bilinear_taps(rows, heights, side)  # [N, 2]
    col_taps, col_weights = _bilinear_taps(cols, widths, side)
    index = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)  # [N, 4]
    weight = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)  # [N, 4]
    return index, weight


def frame_bounds(grids: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """cu_seqlens of the frames: [frames + 1] int32, the first patch row of each frame of each image
    (an image of t frames is t segments of h * w rows), then the patch count."""
    sizes = [h * w for t, h, w in grids for _ in range(t)]
    bounds = torch.zeros(len(sizes) + 1, dtype=torch.int64)
    bounds[1:] = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
    return bounds.to(device=device, dtype=torch.int32)


def rotary_cos_sin(
    rows: torch.Tensor, cols: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tower's 2-D rotary: [patches, head_dim] float32 cos and sin. A head's first quarter of
    frequencies turns with the patch's row, the second with its column; that half is repeated, so
    rotating by halves (x1, x2) → (-x2, x1) pairs dimension i with i + head_dim/2."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=rows.device) / half))
    angles = torch.cat(
        [rows.to(torch.float32)[:, None] * inv_freq, cols.to(torch.float32)[:, None] * inv_freq], dim=-1
    )  # [N, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [N, head_dim]
    return angles.cos(), angles.sin()
