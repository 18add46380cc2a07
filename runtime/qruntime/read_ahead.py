"""Reading an artifact's weight files ahead, into the OS page cache, while the process still imports
torch and the engine (seconds of a cold start: the weight reader itself starts only once they are
imported). The weight reader then finds the first files in memory and the disk was never idle.

Imports nothing heavy. The files are the `weights/` safetensors the manifest lists, each reached as
qruntime.artifact confines any read (no link, nothing outside the artifact); any problem with the
artifact (no manifest, a junk one, a missing file) means no read-ahead, and the load reports it.
The work is bounded: each file once, no more bytes than half the memory the OS calls available.
THREADS threads read chunks into scratch buffers of their own. How many is a trade: the import the
read-ahead overlaps reads torch's libraries from the same disk. On an H200 machine, page cache
dropped, qwen3-8b (at 2d41d01, two trials each, by the probe that became bench/read_ahead_ab.py),
from `import qruntime` to loaded: no read-ahead 14.7 / 16.7 s (imports 7.5-7.8 s, then the weights
5.8-7.8 s), 8 threads 14.3 / 15.1 s (imports 11.9-12.7 s, the weights then all in memory), 2
threads 13.5 / 13.6 s (imports 11.3 s), the libraries read first (3.8 GB of them) 17.1 / 18.3 s.
One posix_fadvise(WILLNEED) thread, at a71ce38 on another host, kept ~0.9 GB/s of the disk busy.
On qwen3-30b-a3b (31 GB, 870b72a) the 2 threads still slowed the import to 11.7-13.3 s: each page
torch's import faults in waits behind the reads queued before it. `idle_io` puts the threads in the
idle I/O class (ioprio_set, Linux), whose reads an I/O scheduler that honours classes (mq-deadline,
bfq; not `none`) serves only when no other read waits: off by default until an A/B says it pays
(bench/read_ahead_ab.py's `idle=N`).
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qruntime.artifact import ArtifactFormatError, artifact_path, read_manifest

CHUNK_BYTES = 16 << 20  # one read; stop() is noticed between two
THREADS = 2  # see the module doc
MEMORY_SHARE = 0.5  # of MemAvailable: the most the read-ahead brings in
WEIGHTS_DIR = "weights/"
MEMINFO = Path("/proc/meminfo")
IDLE_IO = False  # see the module doc
IOPRIO_SET = {"x86_64": 251, "aarch64": 30}  # the ioprio_set system call's number, per architecture
IOPRIO_WHO_PROCESS, IOPRIO_CLASS_IDLE, IOPRIO_CLASS_SHIFT = 1, 3, 13


@dataclass(frozen=True)
class WeightFile:
    path: Path
    size: int


def weight_files(root: str | Path, manifest: dict[str, Any] | None = None) -> list[WeightFile]:
    """The artifact's weight files, in the manifest's order of names (`manifest`: root's, as
    read_manifest gave it; None: read here); [] for anything that is not a readable local artifact
    (the load itself then says what is wrong)."""
    try:
        manifest = manifest if manifest is not None else read_manifest(root)
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


def read_chunk(fd: int, offset: int, length: int, scratch: bytearray) -> None:
    """Read [offset, offset + length) of fd into scratch: its pages are then in the page cache."""
    view = memoryview(scratch)[:length]
    while view:
        got = os.preadv(fd, [view], offset)
        if got <= 0:
            return
        view, offset = view[got:], offset + got


class ReadAhead:
    """THREADS threads that read the weight files, chunk by chunk in order, until done or stopped.

    with ReadAhead.of_artifact(path):
        ...import torch, load...
    """

    def __init__(
        self,
        files: list[WeightFile],
        budget: int,
        fetch: Callable[[int, int, int, bytearray], None] | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        threads: int | None = None,
        idle_io: bool | None = None,
    ):
        self.files, self.budget, self.chunk_bytes = files, budget, chunk_bytes
        self.idle_io = IDLE_IO if idle_io is None else idle_io
        self.fetch = fetch or read_chunk
        self._chunks = chunks(files, budget, chunk_bytes)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, name="qruntime-read-ahead", daemon=True)
            for _ in range((threads or THREADS) if files and budget > 0 else 0)
        ]

    @classmethod
    def of_artifact(cls, path: str | Path, manifest: dict[str, Any] | None = None) -> ReadAhead:
        """For a local artifact directory (a hub URL or a bad artifact: nothing to read); `manifest`
        its read_manifest, where the caller has it."""
        files = [] if str(path).startswith("hf://") else weight_files(path, manifest)
        memory = available_memory()
        total = sum(f.size for f in files)
        return cls(files, total if memory is None else min(total, int(memory * MEMORY_SHARE)))

    @property
    def started(self) -> bool:
        return bool(self._threads) and self._threads[0].ident is not None

    def start(self) -> ReadAhead:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Read nothing more (reads under way finish) and wait for the threads."""
        self._stop.set()
        self.join()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the pass to end, by itself or stopped."""
        for thread in self._threads:
            if thread.ident is not None:
                thread.join(timeout)

    def __enter__(self) -> ReadAhead:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _next(self) -> tuple[WeightFile, int, int] | None:
        with self._lock:
            return None if self._stop.is_set() else next(self._chunks, None)

    def _run(self) -> None:
        if self.idle_io:
            idle_io_priority()
        scratch = bytearray(self.chunk_bytes)
        fds: dict[Path, int] = {}
        try:
            while (chunk := self._next()) is not None:
                file, offset, length = chunk
                if file.path not in fds:
                    fds[file.path] = os.open(file.path, os.O_RDONLY)
                self.fetch(fds[file.path], offset, length, scratch)
        except OSError:
            return  # a file gone or unreadable: the load's own read says so
        finally:
            for fd in fds.values():
                os.close(fd)


def idle_io_priority() -> bool:
    """Put the calling thread's reads in the idle I/O class (Linux ioprio_set on its thread id);
    whether that was done (not on another system or architecture, or where the call is refused)."""
    number = IOPRIO_SET.get(platform.machine())
    if number is None or not hasattr(threading, "get_native_id"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        value = IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT
        return libc.syscall(number, IOPRIO_WHO_PROCESS, threading.get_native_id(), value) == 0
    except (OSError, AttributeError):
        return False
