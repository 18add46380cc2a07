"""qruntime: the lean runtime for qcompile artifacts (torch, safetensors, onnx, tokenizers).

engine = qruntime.load("ART")
out = engine.generate("Hello", qruntime.SamplingParams(max_tokens=32))[0]
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "Engine",
    "InvalidRequest",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "StreamDelta",
    "WorkerError",
    "load",
]

if TYPE_CHECKING:
    from qruntime.engine.engine import Engine
    from qruntime.engine.outputs import InvalidRequest, RequestOutput, StreamDelta
    from qruntime.engine.sampling_params import SamplingParams
    from qruntime.engine.speculative.config import SpeculativeConfig
    from qruntime.engine.workers import WorkerError

_EXPORTS = {
    "Engine": "qruntime.engine.engine",
    "InvalidRequest": "qruntime.engine.outputs",
    "RequestOutput": "qruntime.engine.outputs",
    "StreamDelta": "qruntime.engine.outputs",
    "SamplingParams": "qruntime.engine.sampling_params",
    "SpeculativeConfig": "qruntime.engine.speculative.config",
    "WorkerError": "qruntime.engine.workers",
}


def load(path: str | Path, *args: Any, **kwargs: Any) -> Engine:
    """Load a qcompile artifact and return an Engine: qruntime.loader.load, whose documentation gives
    every argument. A local artifact's weight files are first read ahead into the page cache
    (qruntime.read_ahead), while this call imports torch and the engine, which takes seconds in a
    fresh process; description["load_seconds"]["imports"] is that import's time. Right after torch,
    the artifact's kernels start building (qruntime.early_prebuild), before the engine's imports."""
    from qruntime.artifact import read_manifest_or_none
    from qruntime.read_ahead import ReadAhead

    manifest = read_manifest_or_none(path)  # once: the read-ahead, the early build and the load use it
    with ReadAhead.of_artifact(path, manifest):
        started = time.perf_counter()
        from qruntime.early_prebuild import start_early  # imports torch

        early = start_early(path, args, kwargs, manifest)
        try:
            from qruntime.loader import load as load_artifact

            imports = time.perf_counter() - started
            engine = load_artifact(path, *args, **kwargs, started_prebuild=early, manifest=manifest)
        finally:
            if early is not None:  # a no-op once the load took it over and waited for it
                early.cancel()
    seconds = engine.description["load_seconds"]
    engine.description["load_seconds"] = {
        "imports": round(imports, 3),
        **seconds,
        "total": round(seconds["total"] + imports, 3),
    }
    return engine


def __getattr__(name: str) -> Any:
    # lazy: `import qruntime` (e.g. by the compiler for kv_layout) does not import torch
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'qruntime' has no attribute {name!r}")
