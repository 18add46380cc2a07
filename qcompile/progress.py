"""The progress bars of long commands: on a terminal only, gone when done."""

from __future__ import annotations

from tqdm import tqdm


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "B") -> tqdm:
    """A tqdm bar over `total` (bytes, scaled by 1024, unless another unit is named); `enabled`
    False hides it, True shows it where stderr is a terminal."""
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024,
        disable=None if enabled else True,
        leave=False,
    )
