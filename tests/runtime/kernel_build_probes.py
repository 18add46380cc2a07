"""Checks of qruntime.kernel_builds that need the runtime's kernels as Triton JITFunctions, run by
test_kernel_builds.py in a fresh process without TRITON_INTERPRET (under the interpreter, which the
test session runs, @triton.jit makes interpreted functions that Triton cannot compile).

    python kernel_build_probes.py PROBE '<json args>'   ->   one JSON line on stdout
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

SM90 = ("cuda", 90, 32)


def _record(data: dict) -> Any:
    from qruntime.kernel_builds import KernelBuild

    return KernelBuild.from_dict(data, "test")


def _entry(record: Any, fn: Any = None, target: tuple = SM90, options: dict | None = None) -> str:
    from qruntime.kernel_prebuild import cache_entry
    from triton.backends.compiler import GPUTarget

    fn = fn if fn is not None else record.resolve()
    return str(cache_entry(record.source(fn), GPUTarget(*target), dict(record.options) if options is None else options))


def resolve(records: list[dict]) -> list[str]:
    """Each record's kernel function name, or the ValueError it raises."""
    out = []
    for data in records:
        try:
            out.append("ok: " + _record(data).resolve().fn.__name__)
        except ValueError as exc:
            out.append(str(exc))
    return out


def build(record: dict) -> dict:
    """build_record's result, and the cache folder the record keys."""
    from qruntime.kernel_prebuild import build_record

    result = build_record(SM90, _record(record))
    return result | {"entry": _entry(_record(record))}


def source(record: dict) -> dict:
    """The ASTSource's decoded constants (type and text), or the ValueError building it raises."""
    r = _record(record)
    try:
        src = r.source(r.resolve())
    except ValueError as exc:
        return {"error": str(exc)}
    return {"constants": {str(k[0]): [type(v).__name__, str(v)] for k, v in src.constants.items()}}


def keys(record: dict, tmp: str) -> dict:
    """The cache folders of the record, and of it with one thing changed each: num_warps, a
    constexpr, the target, the kernel's source (two copies of its module, one statement changed)."""
    r = _record(record)
    fn = r.resolve()
    changed_block = _record(record | {"constants": [[[5], 512], *record["constants"][1:]]})
    out = {
        "entry": _entry(r),
        "num_warps": _entry(r, options={"num_warps": 8}),
        "constant": _entry(changed_block, fn),
        "target": _entry(r, target=("cuda", 80, 32)),
    }
    text = Path(inspect.getfile(fn.fn)).read_text()
    for i, body in enumerate((text, text.replace("row = tl.program_id(0)", "row = 0 + tl.program_id(0)"))):
        path = Path(tmp) / f"copy{i}.py"
        path.write_text(body)
        spec = importlib.util.spec_from_file_location(f"copy{i}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look themselves up there
        spec.loader.exec_module(module)
        out[f"copy{i}"] = _entry(r, getattr(module, fn.fn.__name__))
    return out


def record_hook(record: dict) -> dict:
    """Drive recorded_builds' hook as Triton's JIT does after a compile (twice for one
    specialization, once for a kernel of another package) under a hook set before."""
    import triton
    from qruntime.kernel_builds import recorded_builds
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JitFunctionInfo, serialize_specialization_data

    r = _record(record)
    fn = r.resolve()
    src = r.source(fn)
    options = make_backend(GPUTarget(*SM90)).parse_options(dict(r.options))
    args = [f"{fn.module}.{fn.fn.__qualname__}", src.signature, src.constants, src.attrs, options, "key"]
    if "target" in inspect.signature(serialize_specialization_data).parameters:  # triton > 3.6
        args.append(GPUTarget(*SM90))
    spec = serialize_specialization_data(*args)
    calls: list[str] = []
    knobs = triton.knobs.runtime
    knobs.jit_post_compile_hook = before = lambda **kw: calls.append(kw["fn"].name)
    ours = {"key": "k", "repr": "r", "compile": {"specialization_data": spec}, "is_manual_warmup": False}
    with recorded_builds() as recording:
        swapped = knobs.jit_post_compile_hook is not before
        for info in [JitFunctionInfo(fn.module, fn.fn.__qualname__, fn)] * 2 + [
            JitFunctionInfo("triton.language.standard", "other", fn)
        ]:
            knobs.jit_post_compile_hook(fn=info, **ours)
    return {
        "swapped": swapped,
        "restored": knobs.jit_post_compile_hook is before,
        "calls": calls,
        "recorded": [k.to_dict() for k in recording.kernels],
        "skipped": recording.skipped,
        "same_entry": [_entry(k, fn) for k in recording.kernels] == [_entry(r, fn)],
    }


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(name))
    return out


def prebuild(records: list[dict], target: list, jobs: int, timeout: float, after_workers: bool = False) -> dict:
    """A Prebuild of the records: its report, the warnings it gave, the seconds it took, the
    workers its build process made, and whether that process or any worker outlived it.
    after_workers: the deadline `timeout` seconds after its workers are seen running."""
    import dataclasses
    import time
    import warnings

    from qruntime.kernel_prebuild import Prebuild

    began = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = Prebuild([_record(r) for r in records], tuple(target), jobs)
        leader = built._pid
        if after_workers:
            seen = time.monotonic() + 120
            while len(_children(leader)) < jobs and time.monotonic() < seen:
                time.sleep(0.02)
            timeout += time.perf_counter() - built.start
        report = built.wait(timeout)
    elapsed = time.perf_counter() - began
    deadline = time.monotonic() + 10  # a killed worker, reparented, is reaped by whoever adopts it
    while any(_alive(w) for w in built.workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    return dataclasses.asdict(report) | {
        "summary": report.summary(),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
        "elapsed": elapsed,
        "workers": len(built.workers),
        "workers_alive": any(_alive(w) for w in built.workers),
        "leader_alive": os.path.exists(f"/proc/{leader}"),  # reaped: not even a zombie
        "keys_alive": built._keys.is_alive(),
    }


def warm(records: list[dict], target: list, halted: bool = False) -> dict:
    """warm_keys over the records in a fresh process (halted: its halt event set first): whether
    each record's kernel had its Triton cache key (the hash of its sources, JITFunction.hash)
    before and after."""
    import threading

    from qruntime.kernel_prebuild import SPECIALIZE_IMPORTS, warm_keys

    recs = [_record(r) for r in records]
    fns = [r.resolve() for r in recs]
    before = [fn.hash is not None for fn in fns]
    halt = threading.Event()
    if halted:
        halt.set()
    imported = [module in sys.modules for module in SPECIALIZE_IMPORTS]
    warm_keys(recs, tuple(target), halt)
    return {
        "before": before,
        "after": [fn.hash is not None for fn in fns],
        "imported": [imported, [module in sys.modules for module in SPECIALIZE_IMPORTS]],
    }


def timed(records: list[dict], target: list, jobs: int) -> dict:
    """longest_first over the records: the order it gives (indices into `records`) with each one's
    seconds, and the entries it left in this process's Triton cache (TRITON_CACHE_DIR)."""
    from qruntime.kernel_prebuild import longest_first
    from triton import knobs

    recs = [_record(r) for r in records]
    order = longest_first(recs, tuple(target), jobs)
    cache = Path(knobs.cache.dir)
    return {
        "order": [recs.index(record) for record, _ in order],
        "seconds": [seconds for _, seconds in order],
        "cache_entries": sorted(p.name for p in cache.iterdir()) if cache.is_dir() else [],
    }


def early(records: list[dict], target: list, adopt: bool) -> dict:
    """A Prebuild started with warm=False (before the load imported its kernels): whether its key
    thread ran before `adopt`, and, adopted and waited for or cancelled, its report (None when
    cancelled), whether each kernel's key was computed, and whether its thread or process lives on."""
    import time

    from qruntime.kernel_prebuild import Prebuild

    recs = [_record(r) for r in records]
    built = Prebuild(recs, tuple(target), 1, warm=False)
    time.sleep(0.2)
    fns = [r.resolve() for r in recs]
    before = built._keys.ident is not None or any(fn.hash is not None for fn in fns)
    leader = built._pid
    report = None
    if adopt:
        report = built.adopt().wait(300)
    built.cancel()  # also after a wait: the load's caller does it either way
    return {
        "keys_before_adopt": before,
        "summary": None if report is None else report.summary(),
        "early": None if report is None else report.early,
        "hashed": [fn.hash is not None for fn in fns],
        "keys_alive": built._keys.is_alive(),
        "leader_alive": _alive(leader),
    }


def cancel(records: list[dict], target: list, jobs: int, at_once: bool) -> dict:
    """A Prebuild cancelled (a load that failed) at once, or once its workers run: how long cancel
    took, how many workers there were, whether the build process or a worker lives on."""
    import time

    from qruntime.kernel_prebuild import Prebuild

    built = Prebuild([_record(r) for r in records], tuple(target), jobs)
    leader = built._pid
    workers: list[int] = []
    deadline = time.monotonic() + 120
    while not at_once and len(workers) < jobs and time.monotonic() < deadline:
        time.sleep(0.02)
        workers = _children(leader)
    began = time.perf_counter()
    built.cancel()
    seconds = time.perf_counter() - began
    wait_until = time.monotonic() + 10
    while any(_alive(w) for w in workers) and time.monotonic() < wait_until:
        time.sleep(0.05)
    return {
        "seconds": seconds,
        "workers": len(workers),
        "alive": any(_alive(w) for w in workers) or os.path.exists(f"/proc/{leader}"),
        "keys_alive": built._keys.is_alive(),
    }


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]](*json.loads(sys.argv[2]))))
