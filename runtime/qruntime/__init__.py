"""qruntime: the lean runtime for qcompile artifacts (torch, safetensors, onnx, tokenizers).

engine = qruntime.load("ART")
out = engine.generate("Hello", qruntime.SamplingParams(max_tokens=32))[0]
"""

from __future__ import annotations

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
    from qruntime.loader import load

_EXPORTS = {
    "Engine": "qruntime.engine.engine",
    "InvalidRequest": "qruntime.engine.outputs",
    "RequestOutput": "qruntime.engine.outputs",
    "StreamDelta": "qruntime.engine.outputs",
    "SamplingParams": "qruntime.engine.sampling_params",
    "SpeculativeConfig": "qruntime.engine.speculative.config",
    "WorkerError": "qruntime.engine.workers",
    "load": "qruntime.loader",
}


def __getattr__(name: str) -> Any:
    # lazy: `import qruntime` (e.g. by the compiler for kv_layout) does not import torch
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'qruntime' has no attribute {name!r}")
