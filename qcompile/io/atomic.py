"""Write a directory so that it appears at its path only when complete."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qcompile.errors import ArtifactError, QCompileError
from qcompile.units import human_bytes


def check_target(target: Path, force: bool) -> None:
    """Refuse an existing target unless `force`; refuse a target that is a file either way."""
    if target.exists() or target.is_symlink():
        if not force:
            raise ArtifactError(f"{target}: already exists; pass --force to replace it")
        if not target.is_dir() or target.is_symlink():
            raise ArtifactError(f"{target}: exists and is not a directory; refusing to replace it")


def check_free_space(parent: Path, needed: int, what: str, error: type[QCompileError] = ArtifactError) -> None:
    """Refuse up front when `needed` bytes (plus 1% and a little for metadata) do not fit under
    `parent` (its nearest existing ancestor); `what` names the output in the message."""
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if free < needed * 1.01 + (16 << 20):
        raise error(
            f"{parent}: {what} needs about {human_bytes(needed)} but only {human_bytes(free)} is free; "
            "free some space or choose another output directory"
        )


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM for a few statements that must not be split (create-and-register a temp
    dir; the renames that publish it); a signal that arrives meanwhile is raised again right after,
    to the handler that was in place.

    The Python-level handlers are swapped for one that only notes the signal: a signal mask would
    hold it for this thread only, and the kernel hands a process-directed signal to any thread that
    does not block it (torch's, a writer pool's), after which Python runs the handler here at once.
    An ignored signal stays ignored: a process started with SIGINT ignored (a shell script's
    `cmd &`) keeps ignoring it, so no SIGINT is noted here and raised again.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        # None: a handler not set from Python, left alone; SIG_IGN: nothing to hold
        if signal.getsignal(signum) not in (None, signal.SIG_IGN):
            previous[signum] = signal.signal(signum, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)


class AtomicOutputDir:
    """`with AtomicOutputDir(target, force) as tmp:` yields a temporary directory beside `target`;
    on success it is renamed to `target`.

    Any exception, KeyboardInterrupt included, removes the temporary directory and leaves
    `target` as it was. With `force`, an existing target is replaced only after the new one is
    complete (moved aside, the new one renamed in, the old one deleted). Ctrl-C can land between
    any two statements, so the two places where that would leak a directory or lose the old
    target hold signals until they are done. A signal can still land where no Python code can
    guard (as `__exit__` is entered), so the removal is also a `weakref.finalize`: it runs when
    this object is collected or, at the latest, when the interpreter exits.
    """

    def __init__(self, target: str | Path, force: bool = False) -> None:
        self.target = Path(target).absolute()
        self.force = force
        self._tmp: Path | None = None
        self._remove: weakref.finalize | None = None

    def __enter__(self) -> Path:
        check_target(self.target, self.force)
        self.target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with _signals_deferred():
                self._tmp = Path(
                    tempfile.mkdtemp(prefix=f".{self.target.name}.", suffix=".tmp", dir=self.target.parent)
                )
                umask = os.umask(0)
                os.umask(umask)
                self._remove = weakref.finalize(self, shutil.rmtree, self._tmp, ignore_errors=True)
                self._tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the artifact is an ordinary directory
        except BaseException:
            self._discard()
            raise
        return self._tmp  # a held signal was raised inside the try; nothing from here to the body checks

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        try:
            if exc_type is None:
                self._publish()
        finally:
            self._discard()

    def _publish(self) -> None:
        check_target(self.target, self.force)  # someone may have created it while we worked
        with _signals_deferred():
            old = None
            if self.target.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", suffix=".old", dir=self.target.parent))
                old.rmdir()
                self.target.rename(old)
            assert self._tmp is not None and self._remove is not None
            self._tmp.rename(self.target)
            self._remove.detach()
            self._tmp = None
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)

    def _discard(self) -> None:
        if self._remove is not None:
            self._remove()  # removes the directory once; nothing after a detach
        self._tmp = None


def atomic_output_dir(target: str | Path, force: bool = False) -> AtomicOutputDir:
    """`with atomic_output_dir(target, force) as tmp:` — see AtomicOutputDir."""
    return AtomicOutputDir(target, force)
