"""Let PyPI's torchvision import beside the CPU build of torch (a test-only dependency).

PyPI's torchvision 0.28.0 wheel is built against torch's CUDA build: beside torch 2.13.0+cpu its C
extension (`_C.so`, the detection ops) does not load, and `import torchvision` then fails in
`torchvision/_meta_registrations.py` with "operator torchvision::nms does not exist" (it registers
fake kernels for `nms` and `qnms` whether or not the extension loaded). Once torchvision is installed,
transformers imports it from its image and video processors, so that failure would reach every test
that builds one. The tests need only torchvision's pure-torch transforms (transformers'
Qwen3VLVideoProcessor resizes with `torchvision.transforms.v2.functional.resize`, i.e. torch's
`interpolate`), never the detection ops: when the extension does not load, the two operator schemas
are declared (no kernel) so that the import goes through. Where it loads (a CUDA torch) nothing is
declared.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)


def declare_missing_torchvision_ops() -> object | None:
    """Declare torchvision's nms / qnms schemas when its C extension cannot load; returns the library.

    Call before anything imports torchvision. Returns None when torchvision is not installed or its
    extension loads; otherwise the `torch.library.Library` holding the schemas (keep it alive).
    """
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return None
    import torch

    extension = next(Path(spec.origin).parent.glob("_C*.so"), None)
    if extension is not None:
        try:
            torch.ops.load_library(str(extension))
            return None
        except OSError:
            pass
    library = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        library.define(schema)
    return library
