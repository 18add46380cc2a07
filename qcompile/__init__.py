"""qcompile: an offline compiler from Hugging Face Qwen3 checkpoints to PTPC-FP8 artifacts."""

__version__ = "0.1.0"
