"""Random-weight Qwen3 checkpoints with a locally trained tokenizer, for trying everything offline.

`write_checkpoint("tiny", out_dir)` writes a complete Hugging Face checkpoint directory; presets
are listed by `preset_names()`. The CLI verb is `qcompile synth PRESET -o DIR`.
"""

from qcompile.synth.checkpoint import (
    DEFAULT_MAX_SHARD_BYTES,
    CheckpointPlan,
    SynthResult,
    plan_checkpoint,
    resolve_config,
    write_checkpoint,
)
from qcompile.synth.presets import Preset, UnknownPresetError, get_preset, preset_names
from qcompile.synth.tokenizer import TokenizerLayout, build_tokenizer, write_tokenizer_files

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "CheckpointPlan",
    "Preset",
    "SynthResult",
    "TokenizerLayout",
    "UnknownPresetError",
    "build_tokenizer",
    "get_preset",
    "plan_checkpoint",
    "preset_names",
    "resolve_config",
    "write_checkpoint",
    "write_tokenizer_files",
]
