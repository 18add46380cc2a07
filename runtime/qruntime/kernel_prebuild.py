"""Build an artifact's recorded Triton kernels (qruntime.kernel_builds) in parallel, beside the load.

Left to Triton's JIT, each kernel compiles when a step first launches it, one after another on the
load's path (graph capture, warm-up steps): a 0.6B engine's first load on an H200 spent ~36 s there.
`Prebuild` forks one build process, which looks each record up in Triton's cache (the key as
triton.compile computes it, `cache_entry`; an entry whose files do not parse counts as missing),
then forks one worker per core for the rest, each compiling records into that cache with
triton.compile for this GPU's architecture and, on a Triton that compiles a C launcher per kernel
signature (3.6), building the launcher too. Forked from the loading process (before its reader
threads start) so the workers start with its imports (torch, Triton, the kernel modules) instead
of paying them again; they touch no GPU and no CUDA context, as PyTorch's DataLoader workers forked
from a CUDA process do not. The load reads the weights
meanwhile and `wait`s before its first launch; the JIT then finds every recorded kernel in the
cache and only loads it. Past the deadline the workers are killed and what is left builds as it
launches, as without a list.

A cache entry Triton cannot read back (a torn or corrupt file) is removed and built again, with a
warning; a record that fails to build is reported with its kernel and configuration and left to
the JIT. Nothing here changes what runs: the JIT keys every launch by its own specialization, and
a record that differs from it only built a kernel nobody launches.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Container, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qruntime.kernel_builds import KernelBuild, read_build_list

# what Triton's first launch of any kernel imports, to check its arguments' types against (its C++
# specialization does): 0.2 s of a warm qwen3-8b's first token on an H200, imported beside the load instead
SPECIALIZE_IMPORTS = ("triton.tools.tensor_descriptor", "triton.experimental.gluon.nvidia.hopper")
DEADLINE_S = 300.0  # the longest a load waits for its kernels (an 8B engine's ~100 builds take ~20 s on one core)
MAX_ERROR_CHARS = 2000
Target = tuple[str, "int | str", int]  # Triton's GPUTarget fields: backend, arch, warp size


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
    early: bool = False  # started at the load's call, before its imports (qruntime.early_prebuild)

    def summary(self) -> str:
        parts = [f"{self.built} built", f"{self.cached} cached"]
        parts += [f"{self.rebuilt} rebuilt"] * bool(self.rebuilt) + [f"{len(self.failed)} failed"] * bool(self.failed)
        parts += [f"{self.unfinished} cut off by the deadline"] * bool(self.unfinished)
        started = ", started at the load's call" if self.early else ""
        return f"{self.total} kernels: {', '.join(parts)} in {self.seconds:.1f} s ({self.waited:.1f} s waited{started})"


class Prebuild:
    """`records` building for `target` with up to `jobs` workers (module docstring); `launchers`:
    build each kernel's C launcher too (on the GPU's machine: it links libcuda).

    The load forks one process and goes on reading its weights: that process (`_coordinate`, the
    leader of a process group of its own) looks every record up in Triton's cache, forks the
    workers for the missing ones from its single thread, and reports each result on a pipe. The
    lookups used to run on the load's own thread first: 1.05 s of a warm qwen3-8b load on an H200,
    0.42 s of it Triton hashing its own sources for the cache key, which the load's JIT needs too:
    a thread of the load computes it meanwhile, and each record's key after it (warm_keys: the
    first token of a warm 8B load spent 0.2 s hashing kernel sources), joined by `wait`."""

    def __init__(
        self, records: Sequence[KernelBuild], target: Target, jobs: int, launchers: bool = False, warm: bool = True
    ) -> None:
        import multiprocessing

        self.records, self.start = tuple(records), time.perf_counter()
        self.results: dict[int, dict[str, Any]] = {}
        self.workers: tuple[int, ...] = ()  # the coordinator's worker pids, once it reports them
        self.finished_at: float | None = None
        reader, writer = multiprocessing.get_context("fork").Pipe(duplex=False)
        self._conn = reader
        pid = os.fork()
        if pid == 0:  # the coordinator: it never returns into the load's code
            code = 0
            try:
                reader.close()
                _coordinate(writer, self.records, target, jobs, launchers)
            except BaseException:  # noqa: BLE001 - the parent reports the records it never heard of
                code = 1
            finally:
                os._exit(code)
        writer.close()
        self._pid: int | None = pid
        self._halt = threading.Event()
        self._keys = threading.Thread(
            target=warm_keys, args=(self.records, target, self._halt), name="triton-keys", daemon=True
        )
        self.early = not warm  # started before the load's imports (qruntime.early_prebuild)
        if warm:
            self._keys.start()

    def adopt(self) -> Prebuild:
        """The load that will launch the kernels takes this build over (started with warm=False,
        before it imported them): its key thread starts now."""
        if self._keys.ident is None and not self._halt.is_set():
            self._keys.start()
        return self

    def cancel(self) -> None:
        """Stop the build now (a load that failed): the coordinator and its workers killed, the key
        thread ended (it stops between two records; left running, an interpreter exiting under it
        while it is inside Triton's C++ aborts the process)."""
        self._halt.set()
        self._stop()
        if self._keys.ident is not None:
            self._keys.join()

    def _stop(self) -> None:
        if self._pid is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._pid, signal.SIGKILL)  # the coordinator leads its group: its workers too
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._pid, signal.SIGKILL)  # killed before it made its group
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self._pid, 0)
        self._pid = None
        self._conn.close()

    def wait(self, timeout: float = DEADLINE_S) -> PrebuildReport:
        """Wait for the build, at most `timeout` seconds after the start; then stop what is left.
        Warns once for failed records and cache entries built again."""
        began = time.perf_counter()
        if self._keys.ident is not None:  # before any launch: the JIT reads what it sets
            self._keys.join(max(0.0, self.start + timeout - began))
        done = False
        while self._pid is not None and not done:
            left = self.start + timeout - time.perf_counter()
            try:
                if not self._conn.poll(max(0.0, left)):
                    break  # the deadline
                message = self._conn.recv()
            except (EOFError, OSError):  # the coordinator ended without saying it was done
                for index in range(len(self.records)):
                    self.results.setdefault(index, {"status": "failed", "error": "the build process ended early"})
                break
            if message[0] == "result":
                self.results[message[1]] = message[2]
            elif message[0] == "workers":
                self.workers = tuple(message[1])
            else:  # "done"
                done = True
        self.finished_at = time.perf_counter()
        self._stop()  # reaps it when done; past the deadline, stops what still compiles
        waited = self.finished_at - began
        counts = {"built": 0, "cached": 0, "rebuilt": 0}
        failed, rebuilt = [], []
        for index, result in sorted(self.results.items()):
            status = result.get("status")
            if status in counts:
                counts[status] += 1
            if status == "failed":
                failed.append(f"{self.records[index].describe()}: {result.get('error')}")
            elif status == "rebuilt":
                rebuilt.append(f"{self.records[index].describe()} ({result.get('error')})")
        report = PrebuildReport(
            total=len(self.records),
            built=counts["built"],
            cached=counts["cached"],
            rebuilt=counts["rebuilt"],
            failed=tuple(failed),
            seconds=round(self.finished_at - self.start, 3),
            waited=round(waited, 3),
            unfinished=len(self.records) - len(self.results),
            early=self.early,
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


def _coordinate(conn: Any, records: Sequence[KernelBuild], target: Target, jobs: int, launchers: bool) -> None:
    """The build process (Prebuild): a process group of its own, the records looked up in Triton's
    cache, the missing ones compiled by up to `jobs` workers forked from here; every result sent
    as ("result", index, result), the workers' pids as ("workers", pids), then ("done",)."""
    import multiprocessing

    from triton.backends.compiler import GPUTarget

    os.setpgid(0, 0)
    todo = []
    for index, record in enumerate(records):
        try:
            src = record.source(record.resolve())
            cached = _readable(cache_entry(src, GPUTarget(*target), dict(record.options)))
        except Exception as exc:  # noqa: BLE001 - not ours (ValueError), or no backend for the target
            conn.send(("result", index, {"status": "failed", "error": _one_line(exc)}))
            continue
        if cached:
            conn.send(("result", index, {"status": "cached", "error": None}))
        else:
            todo.append(index)
    if todo:
        with ProcessPoolExecutor(max(1, min(jobs, len(todo))), multiprocessing.get_context("fork")) as pool:
            futures = {pool.submit(build_record, target, records[index], launchers): index for index in todo}
            conn.send(("workers", [p.pid for p in (getattr(pool, "_processes", None) or {}).values()]))
            for future in as_completed(futures):
                try:
                    result = future.result()
                except Exception as exc:  # noqa: BLE001 - a worker died: reported, left to the JIT
                    result = {"status": "failed", "error": _one_line(exc)}
                conn.send(("result", futures[future], result))
    conn.send(("done",))
    conn.close()


def warm_keys(records: Sequence[KernelBuild], target: Target, halt: threading.Event | None = None) -> None:
    """What the JIT's first launch of each record computes before it finds the kernel in the cache:
    Triton's key of its own sources, then each kernel's cache key (its source and those of the
    functions it calls, hashed once a process), and the modules its first launch imports
    (SPECIALIZE_IMPORTS), so that the first step only loads the kernels. Run on a thread of the load
    (hashing: no fork, no CUDA) while it reads the weights; a record that fails here is left to the
    JIT, which fails the same way. `halt` set: stop before the next record."""
    import importlib

    with contextlib.suppress(Exception):
        from triton.backends.compiler import GPUTarget
        from triton.runtime.cache import triton_key

        triton_key()
        for module in SPECIALIZE_IMPORTS:
            with contextlib.suppress(ImportError):  # a Triton without it checks nothing against it
                importlib.import_module(module)
        gpu = GPUTarget(*target)
        for record in records:
            if halt is not None and halt.is_set():
                return
            with contextlib.suppress(Exception):
                cache_entry(record.source(record.resolve()), gpu, dict(record.options))


def longest_first(records: Sequence[KernelBuild], target: Target, jobs: int) -> list[tuple[KernelBuild, float | None]]:
    """`records`, each with the seconds it takes to compile for `target`, longest first: built by a
    Prebuild of `jobs` workers into an empty Triton cache, removed after (this process's cache is
    not touched), each timed by its worker; a record that fails to build comes last, with None.
    A load's prebuild hands the records to its workers in the list's order, so a list kept in this
    order ends sooner: the 46 kernels of a qwen3-8b on an H200 took 38.9 s of compiling, at most
    1.95 s each; on 15 workers that is 3.4 s in the order they first launch, 2.7 s longest first."""
    import tempfile

    from triton import knobs

    with tempfile.TemporaryDirectory(prefix="qruntime-timed-builds-") as tmp, knobs.cache.scope():
        knobs.cache.dir = tmp  # the forked workers inherit it
        build = Prebuild(records, target, jobs)
        build.wait()
    seconds = [
        result["seconds"] if (result := build.results.get(i, {})).get("status") in ("built", "rebuilt") else None
        for i in range(len(records))
    ]
    order = sorted(range(len(records)), key=lambda i: (seconds[i] is None, -(seconds[i] or 0.0), i))
    return [(records[i], seconds[i]) for i in order]


def default_jobs() -> int:
    """One worker per core this process may use, less one for the load itself."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(64, cores - 1))


def start_prebuild(
    root: str | Path,
    listed: Container[str],
    device_name: str,
    capability: tuple[int, int],
    jobs: int | None = None,
    warm: bool = True,
) -> Prebuild | None:
    """Start building the artifact's recorded kernels for this NVIDIA GPU; None when it has no list
    that fits this GPU and Triton (read_build_list says why when one is there), or when the
    kernels run in Triton's interpreter (TRITON_INTERPRET=1: nothing is compiled). warm=False: the
    key thread waits for `adopt` (a build started before the load imported its kernels)."""
    import triton

    if triton.knobs.runtime.interpret:
        return None
    builds = read_build_list(root, device_name, capability, triton.__version__, listed)
    if builds is None or not builds.kernels:
        return None
    return Prebuild(builds.kernels, nvidia_target(capability), jobs or default_jobs(), launchers=True, warm=warm)


def nvidia_target(capability: tuple[int, int]) -> Target:
    """Triton's target for an NVIDIA GPU of compute capability `capability`."""
    return ("cuda", capability[0] * 10 + capability[1], 32)


def _readable(entry: Path) -> bool:
    """Whether a cache folder holds a kernel Triton can read back: its group file and the metadata
    it names parse, and every file it names is there."""
    try:
        for group in entry.glob("__grp__*.json"):
            paths = json.loads(group.read_text())["child_paths"]
            if all(os.path.exists(p) for p in paths.values()):
                for name, path in paths.items():
                    if name.endswith(".json"):
                        json.loads(Path(path).read_text())
                return True
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return False


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


def build_record(target: Target, record: KernelBuild, launcher: bool = False) -> dict[str, Any]:
    """Compile one record into Triton's cache: {"status": "built" | "cached" | "rebuilt" | "failed",
    "seconds", "error"}. A cache hit Triton cannot read back is removed and compiled again.
    launcher: also build the kernel's C launcher where this Triton compiles one per signature (3.6;
    later versions launch every kernel through one generic launcher)."""
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
            kernel = triton.compile(src, target=gpu, options=options)
            status, note = ("cached" if hits and hits[-1] else "built"), None
        except Exception as exc:  # noqa: BLE001 - a torn entry raises whatever reading it raises
            entry = cache_entry(src, gpu, options)
            if not any(entry.glob("__grp__*")):  # nothing cached: the compile itself failed
                raise
            shutil.rmtree(entry, ignore_errors=True)
            kernel = triton.compile(src, target=gpu, options=options)
            status, note = "rebuilt", _one_line(exc)
        finally:
            knobs.compilation.listener = None
        if launcher:
            from triton.backends.nvidia import driver

            if hasattr(driver, "make_launcher"):  # the C launcher of this signature, compiled into the cache
                driver.CudaLauncher(src, kernel.metadata)
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
