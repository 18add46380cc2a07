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

`install()` does it lazily, when something first imports torchvision: tests/conftest.py installs it
in the test process, and puts tests/torchvision_site (whose sitecustomize installs it) on the
PYTHONPATH of the processes tests start, so that a CLI or an example run by a test (whose
transformers imports torchvision too: `qcompile eval-recipes` loading Qwen3ForCausalLM failed) sees
the same environment. Nothing is imported at start-up beyond this module.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)


def declare_missing_torchvision_ops() -> object | None:
    """Declare torchvision's nms / qnms schemas when its C extension cannot load; returns the library.

    Call before anything imports torchvision. Returns None when torchvision is not installed, its
    extension loads, or the schemas are declared already in this process (a test process whose
    sitecustomize installed the shim before conftest did); otherwise the `torch.library.Library`
    holding the schemas (keep it alive).
    """
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return None
    import torch

    if _declared(torch):
        return None

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


def _declared(torch) -> bool:  # noqa: ANN001 (the module)
    try:
        torch.ops.torchvision.nms.default  # noqa: B018 (the lookup is the check)
    except (AttributeError, RuntimeError):
        return False
    return True


class _DeclareOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing: on the first import of torchvision it declares the schemas, then leaves."""

    def __init__(self) -> None:
        self.library: object | None = None  # keeps the declared schemas alive

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 (the finder protocol)
        if name == "torchvision" and self in sys.meta_path:
            sys.meta_path.remove(self)
            self.library = declare_missing_torchvision_ops()
        return None


def install() -> _DeclareOnImport:
    """Declare the missing schemas when torchvision is first imported in this process."""
    finder = _DeclareOnImport()
    sys.meta_path.insert(0, finder)
    return finder
