"""Build an artifact's recorded Triton kernels (qruntime.kernel_builds) in parallel, beside the load.

Left to Triton's JIT, each kernel compiles when a step first launches it, one after another on the
load's path (graph capture, warm-up steps): a 0.6B engine's first load on an H200 spent ~36 s there.
`Prebuild.start` hands the records to a helper process (`python -m qruntime.kernel_prebuild`) that
imports their modules once, then forks one worker per core, each compiling records into Triton's
own cache (triton.compile for this GPU's architecture: no GPU, no CUDA context is touched). The load
reads the weights meanwhile and `wait`s before its first launch; the JIT then finds every recorded
kernel in the cache and only loads it. A separate process because it can be bounded: past the
load's deadline it is killed (the kernels left build as they launch, as without a list); and
because a compiler that crashes on some record cannot take the load down with it.

A cache entry Triton cannot read back (a torn or corrupt file) is removed and built again, with a
warning; a record that fails to build is reported with its kernel and configuration and left to
the JIT. Nothing here changes what runs: the JIT keys every launch by its own specialization, and
a record that differs from it only built a kernel nobody launches.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qruntime.kernel_builds import KernelBuild, read_build_list

DEADLINE_S = 300.0  # the longest a load waits for its kernels (an 8B engine's ~100 builds take ~20 s on one core)
MAX_ERROR_CHARS = 2000


@dataclass(frozen=True)
class PrebuildReport:
    total: int
    built: int  # compiled now
    cached: int  # already in Triton's cache
    rebuilt: int  # a cache entry unreadable, compiled again
    failed: tuple[str, ...]  # "<kernel[config]>: <error>", left to the JIT
    seconds: float  # from start to the last result (or the deadline)
    waited: float  # of which the load spent waiting
    unfinished: int  # records the deadline cut off

    def summary(self) -> str:
        parts = [f"{self.built} built", f"{self.cached} cached"]
        parts += [f"{self.rebuilt} rebuilt"] * bool(self.rebuilt) + [f"{len(self.failed)} failed"] * bool(self.failed)
        parts += [f"{self.unfinished} cut off by the deadline"] * bool(self.unfinished)
        return f"{self.total} kernels: {', '.join(parts)} in {self.seconds:.1f} s ({self.waited:.1f} s waited)"


class Prebuild:
    """The helper process building `records` for `target` (Triton's GPUTarget fields: backend,
    arch, warp size) with `jobs` workers; `wait` collects its report."""

    def __init__(self, records: Sequence[KernelBuild], target: tuple[str, int | str, int], jobs: int) -> None:
        self.records, self.start = tuple(records), time.perf_counter()
        job = {"target": list(target), "jobs": jobs, "kernels": [r.to_dict() for r in self.records]}
        self.results: dict[int, dict[str, Any]] = {}
        self.errors: list[str] = []
        self.finished_at: float | None = None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qruntime.kernel_prebuild"],
            env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},  # it compiles, whatever we run
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # both pipes drained by threads: the helper never blocks on a full pipe while the load reads weights
        self.reader = threading.Thread(target=self._read, args=(json.dumps(job),), daemon=True)
        self.stderr = threading.Thread(target=self._drain_stderr, daemon=True)
        self.reader.start()
        self.stderr.start()

    def _read(self, job: str) -> None:
        try:
            self.proc.stdin.write(job)
            self.proc.stdin.close()
        except OSError:  # the helper died at once: its stderr says why
            pass
        for line in self.proc.stdout:
            try:
                result = json.loads(line)
                self.results[int(result["index"])] = result
            except (ValueError, KeyError, TypeError):
                self.errors.append(line.strip()[:MAX_ERROR_CHARS])
        self.finished_at = time.perf_counter()

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:
            if len(self.errors) < 50:
                self.errors.append(line.rstrip()[:MAX_ERROR_CHARS])

    def wait(self, timeout: float = DEADLINE_S) -> PrebuildReport:
        """Wait for the helper, at most `timeout` seconds after it started; then kill what is left.
        Warns once for failed records and cache entries built again."""
        began = time.perf_counter()
        self.reader.join(max(0.0, self.start + timeout - began))
        if self.reader.is_alive():
            self.proc.kill()
            self.reader.join()
        self.proc.wait()
        self.stderr.join(5.0)
        for pipe in (self.proc.stdout, self.proc.stderr):
            pipe.close()
        waited = time.perf_counter() - began
        counts = {"built": 0, "cached": 0, "rebuilt": 0}
        failed, rebuilt = [], []
        for index, result in sorted(self.results.items()):
            status = result.get("status")
            if status in counts:
                counts[status] += 1
            name = self.records[index].describe() if 0 <= index < len(self.records) else f"record {index}"
            if status == "failed":
                failed.append(f"{name}: {result.get('error')}")
            elif status == "rebuilt":
                rebuilt.append(f"{name} ({result.get('error')})")
        unfinished = len(self.records) - len(self.results)
        if self.proc.returncode not in (0, None) and unfinished and not (began + waited >= self.start + timeout):
            failed.append(f"the kernel build helper exited with {self.proc.returncode}: {' | '.join(self.errors[-5:])}")
        report = PrebuildReport(
            total=len(self.records),
            built=counts["built"],
            cached=counts["cached"],
            rebuilt=counts["rebuilt"],
            failed=tuple(failed),
            seconds=round((self.finished_at or time.perf_counter()) - self.start, 3),
            waited=round(waited, 3),
            unfinished=unfinished,
        )
        if failed:
            warnings.warn(
                f"{len(failed)} recorded kernel(s) did not build ahead (they build when launched): "
                + "; ".join(failed[:5]),
                stacklevel=2,
            )
        if rebuilt:
            warnings.warn(f"unreadable Triton cache entries built again: {'; '.join(rebuilt[:5])}", stacklevel=2)
        return report


def default_jobs() -> int:
    """One worker per core this process may use, less one for the load itself."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(64, cores - 1))


def start_prebuild(
    root: str | Path, listed: Container[str], device_name: str, capability: tuple[int, int], jobs: int | None = None
) -> Prebuild | None:
    """Start building the artifact's recorded kernels for this NVIDIA GPU; None when it has no list
    that fits this GPU and Triton (read_build_list says why when one is there)."""
    import triton

    if triton.knobs.runtime.interpret:  # the kernels run in Triton's interpreter: nothing is compiled
        return None
    builds = read_build_list(root, device_name, capability, triton.__version__, listed)
    if builds is None or not builds.kernels:
        return None
    return Prebuild(builds.kernels, ("cuda", capability[0] * 10 + capability[1], 32), jobs or default_jobs())


# --- the helper process --------------------------------------------------------------------------


def cache_entry(src: Any, target: Any, options: Mapping[str, Any]) -> Path:
    """The folder of Triton's cache that triton.compile(src, target=target, options=options) reads
    and writes: its key computed as triton.compiler.compile computes it."""
    from triton import knobs
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler import get_cache_key, make_backend
    from triton.runtime.cache import _base32

    backend = make_backend(target)
    parsed = backend.parse_options(dict(options, **src.parse_options()))
    key = get_cache_key(src, backend, parsed, env_vars=get_cache_invalidating_env_vars())
    return Path(knobs.cache.dir) / _base32(hashlib.sha256(key.encode("utf-8")).hexdigest())


def build_record(target: tuple[str, int | str, int], record: KernelBuild) -> dict[str, Any]:
    """Compile one record into Triton's cache: {"status": "built" | "cached" | "rebuilt" | "failed",
    "seconds", "error"}. A cache hit Triton cannot read back is removed and compiled again."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    began = time.perf_counter()
    hits: list[bool] = []

    def listener(**kwargs: Any) -> None:
        hits.append(bool(kwargs.get("cache_hit")))

    try:
        fn = record.resolve()
        src = record.source(fn)
        gpu = GPUTarget(*target)
        options = dict(record.options)
        knobs.compilation.listener = listener
        try:
            triton.compile(src, target=gpu, options=options)
            status, note = ("cached" if hits and hits[-1] else "built"), None
        except Exception as exc:  # noqa: BLE001 - a torn entry raises whatever reading it raises
            entry = cache_entry(src, gpu, options)
            if not any(entry.glob("__grp__*")):  # nothing cached: the compile itself failed
                raise
            shutil.rmtree(entry, ignore_errors=True)
            triton.compile(src, target=gpu, options=options)
            status, note = "rebuilt", _one_line(exc)
        finally:
            knobs.compilation.listener = None
    except Exception as exc:  # noqa: BLE001 - reported, the JIT builds it at launch instead
        status, note = "failed", _one_line(exc)
    return {"status": status, "seconds": round(time.perf_counter() - began, 3), "error": note}


def _one_line(exc: BaseException) -> str:
    """An error and its causes on one line: a CompilationError's text is the kernel's source up to
    the failing call, the reason is its cause's."""
    parts = []
    while exc is not None and len(parts) < 4:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        where = lines[0] if lines and lines[0].startswith("at ") else None
        text = where if where is not None else (lines[-1] if lines else "")
        parts.append(f"{type(exc).__name__}: {text}")
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(parts)[:MAX_ERROR_CHARS]


def _build_indexed(target: tuple[str, int | str, int], item: tuple[int, KernelBuild]) -> dict[str, Any]:
    return {"index": item[0], **build_record(target, item[1])}


def main() -> None:
    """The helper: a job on stdin ({"target", "jobs", "kernels"}), one JSON line per record on stdout."""
    import functools
    import multiprocessing

    job = json.loads(sys.stdin.read())
    target = (str(job["target"][0]), job["target"][1], int(job["target"][2]))
    records = []
    for index, data in enumerate(job["kernels"]):
        try:
            record = KernelBuild.from_dict(data, f"kernels[{index}]")
            record.resolve()  # imports its module here, once: the forked workers share it
            records.append((index, record))
        except ValueError as exc:
            print(json.dumps({"index": index, "status": "failed", "error": str(exc)}), flush=True)
    jobs = max(1, min(int(job["jobs"]), len(records)))
    build = functools.partial(_build_indexed, target)
    if jobs == 1:
        for result in map(build, records):
            print(json.dumps(result), flush=True)
        return
    # fork: this process holds no thread and no CUDA context; the workers inherit its imports
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        for result in pool.imap_unordered(build, records):
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
