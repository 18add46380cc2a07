"""Start-up of the processes tests run (tests/conftest.py puts this folder on PYTHONPATH): the
torchvision shim of tests/torchvision_cpu.py, installed to act on the first import of torchvision."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("torchvision_cpu", Path(__file__).parent.parent / "torchvision_cpu.py")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
_SHIM = _module.install()
