"""qruntime: the lean runtime for qcompile artifacts (torch, safetensors, onnx, tokenizers)."""

__version__ = "0.1.0"
