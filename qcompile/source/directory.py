"""Where a checkpoint is: the cheap checks on its path that `qcompile compile` makes before importing
torch (and Checkpoint.open makes first), so a mistyped path is reported at once."""

from __future__ import annotations

import os
from pathlib import Path

from qcompile.errors import CheckpointError


def check_checkpoint_dir(path: str | Path) -> Path:
    """`path` as a Path; a CheckpointError naming it when it is missing or not a directory."""
    root = Path(path)
    if not os.path.exists(root):  # os.path's checks answer False where pathlib's raise (EACCES on a parent)
        raise CheckpointError(f"{root}: checkpoint directory not found")
    if not os.path.isdir(root):
        raise CheckpointError(
            f"{root}: not a directory; a checkpoint is a directory holding config.json and *.safetensors"
        )
    return root
