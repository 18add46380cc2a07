"""Write a directory so that it appears at its path only when complete."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qcompile.errors import ArtifactError


def check_target(target: Path, force: bool) -> None:
    """Refuse an existing target unless `force`; refuse a target that is a file either way."""
    if target.exists() or target.is_symlink():
        if not force:
            raise ArtifactError(f"{target}: already exists; pass --force to replace it")
        if not target.is_dir() or target.is_symlink():
            raise ArtifactError(f"{target}: exists and is not a directory; refusing to replace it")


@contextmanager
def atomic_output_dir(target: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside `target`; on success it is renamed to `target`.

    Any exception, KeyboardInterrupt included, removes the temporary directory and leaves
    `target` as it was. With `force`, an existing target is replaced only after the new one is
    complete (moved aside, the new one renamed in, the old one deleted).
    """
    target = Path(target).absolute()
    check_target(target, force)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the artifact is an ordinary directory
    try:
        yield tmp
        check_target(target, force)  # someone may have created it while we worked
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            old.rmdir()
            target.rename(old)
        tmp.rename(target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
