"""Reading an artifact's weight files ahead, into the OS page cache, while the process still imports
torch and the engine (seconds of a cold start: the weight reader itself starts only once they are
imported). The weight reader then finds the first files in memory and the disk was never idle.

Imports nothing heavy. The files are the `weights/` safetensors the manifest lists, each reached as
qruntime.artifact confines any read (no link, nothing outside the artifact); any problem with the
artifact (no manifest, a junk one, a missing file) means no read-ahead, and the load reports it.
The work is bounded: each file once, no more bytes than half the memory the OS calls available.
On Linux the pages are asked for with posix_fadvise(WILLNEED), which queues the reads without
copying anything into this process; elsewhere they are read into one scratch buffer.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from qruntime.artifact import ArtifactFormatError, artifact_path, read_manifest

CHUNK_BYTES = 64 << 20  # one request to the OS; stop() is noticed between two
MEMORY_SHARE = 0.5  # of MemAvailable: the most the read-ahead brings in
WEIGHTS_DIR = "weights/"
MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class WeightFile:
    path: Path
    size: int


def weight_files(root: str | Path) -> list[WeightFile]:
    """The artifact's weight files, in the manifest's order of names; [] for anything that is not a
    readable local artifact (the load itself then says what is wrong)."""
    try:
        manifest = read_manifest(root)
        listed = manifest["files"]
        names = sorted(rel for rel in listed if rel.startswith(WEIGHTS_DIR) and rel.endswith(".safetensors"))
        paths = [artifact_path(root, rel, listed=listed) for rel in names]
        return [WeightFile(path, path.stat().st_size) for path in paths]
    except (ArtifactFormatError, OSError, ValueError):
        return []


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where there is none (not Linux)."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def chunks(
    files: list[WeightFile], budget: int, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[tuple[WeightFile, int, int]]:
    """(file, offset, length) covering the files in order, at most `budget` bytes in all."""
    left = budget
    for file in files:
        for offset in range(0, file.size, chunk_bytes):
            length = min(chunk_bytes, file.size - offset, left)
            if length <= 0:
                return
            yield file, offset, length
            left -= length


def advise(fd: int, offset: int, length: int, scratch: bytearray) -> None:
    """Ask for [offset, offset + length) of fd in the page cache."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        return
    view = memoryview(scratch)[:length]
    while view:
        got = os.preadv(fd, [view], offset)
        if got <= 0:
            return
        view, offset = view[got:], offset + got


class ReadAhead:
    """One thread that asks for the weight files' pages, chunk by chunk, until done or stopped.

    with ReadAhead.of_artifact(path):
        ...import torch, load...
    """

    def __init__(
        self,
        files: list[WeightFile],
        budget: int,
        fetch: Callable[[int, int, int, bytearray], None] | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ):
        self.files, self.budget, self.chunk_bytes = files, budget, chunk_bytes
        self.fetch = fetch or advise
        self.requested = 0  # bytes asked for so far
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def of_artifact(cls, path: str | Path) -> ReadAhead:
        """For a local artifact directory (a hub URL or a bad artifact: nothing to read)."""
        files = [] if str(path).startswith("hf://") else weight_files(path)
        memory = available_memory()
        total = sum(f.size for f in files)
        return cls(files, total if memory is None else min(total, int(memory * MEMORY_SHARE)))

    def start(self) -> ReadAhead:
        if self.files and self.budget > 0:
            self._thread = threading.Thread(target=self._run, name="qruntime-read-ahead", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Ask nothing more (a request under way finishes) and wait for the thread."""
        self._stop.set()
        self.join()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the pass to end, by itself or stopped."""
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> ReadAhead:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        scratch = bytearray(0 if hasattr(os, "posix_fadvise") else self.chunk_bytes)
        fd, opened = -1, None
        try:
            for file, offset, length in chunks(self.files, self.budget, self.chunk_bytes):
                if self._stop.is_set():
                    return
                if opened != file.path:
                    if fd >= 0:
                        os.close(fd)
                        fd = -1
                    fd, opened = os.open(file.path, os.O_RDONLY), file.path
                self.fetch(fd, offset, length, scratch)
                self.requested += length
        except OSError:
            return  # a file gone or unreadable: the load's own read says so
        finally:
            if fd >= 0:
                os.close(fd)
