"""sha256 of a file that is written out of order, computed while it is being written.

The weight shards are filled by positional writes from several threads, so the file cannot be
hashed as a stream. It is written *almost* in order, though (jobs are issued in file order, a few
chunks in flight), so a thread that hashes the longest fully written prefix — read back from the
page cache as the prefix grows — is done moments after the last write, instead of re-reading the
whole file afterwards on one core.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
from pathlib import Path

_BLOCK = 8 << 20


class FrontierHasher:
    """Hashes bytes [0, size) of `path` as `mark(begin, end)` reports them written."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        self._starts: list[int] = []  # disjoint, merged written intervals, sorted
        self._ends: list[int] = []
        self._frontier = 0
        self._cond = threading.Condition()
        self._cancelled = False
        self._digest: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"sha256-{path.name}", daemon=True)
        self._thread.start()

    def mark(self, begin: int, end: int) -> None:
        """Bytes [begin, end) are now in the file."""
        if end <= begin:
            return
        with self._cond:
            i = bisect.bisect_left(self._ends, begin)
            # merge with every interval that touches [begin, end)
            j = i
            while j < len(self._starts) and self._starts[j] <= end:
                begin, end = min(begin, self._starts[j]), max(end, self._ends[j])
                j += 1
            self._starts[i:j] = [begin]
            self._ends[i:j] = [end]
            if self._starts[0] == 0 and self._ends[0] > self._frontier:
                self._frontier = self._ends[0]
                self._cond.notify()

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            self._cond.notify()

    def result(self) -> str:
        """The hex digest, once every byte has been marked and hashed."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._digest is None:
            raise RuntimeError(f"{self.path.name}: hashing was cancelled before the file was complete")
        return self._digest

    def _run(self) -> None:
        digest = hashlib.sha256()
        position = 0
        try:
            with open(self.path, "rb", buffering=0) as handle:
                buffer = bytearray(_BLOCK)
                view = memoryview(buffer)
                while position < self.size:
                    with self._cond:
                        while self._frontier <= position and not self._cancelled:
                            self._cond.wait()
                        if self._cancelled:
                            return
                        frontier = self._frontier
                    while position < frontier:
                        want = min(_BLOCK, frontier - position)
                        got = os.preadv(handle.fileno(), [view[:want]], position)
                        if got <= 0:
                            raise OSError(f"{self.path}: short read at byte {position} while hashing")
                        digest.update(view[:got])
                        position += got
            self._digest = digest.hexdigest()
        except BaseException as exc:  # reported by result()
            self._error = exc
