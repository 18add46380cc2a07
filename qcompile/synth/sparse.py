"""Sparse checkpoints: a preset's real config.json, tokenizer and safetensors headers, with every
tensor's data left as a file hole (all-zero weights that take no disk space).

They let the compiler's load / plan / graph stages run at full model scale (a 470 GB
qwen3-235b-a22b) on any disk: `bench/scale_bench.py` measures compile memory on one, and
`qcompile synth --artifact` plans a synthetic artifact from one.
"""

from __future__ import annotations

import json
from pathlib import Path

from qcompile.io.safetensors_stream import StreamingWriter
from qcompile.source.checkpoint import INDEX_FILE
from qcompile.synth.checkpoint import PREPROCESSOR_FILE, plan_checkpoint
from qcompile.synth.tokenizer import write_tokenizer_files

SHARD_BYTES = 5_000_000_000


def write_sparse_checkpoint(preset: str, path: Path) -> int:
    """Headers and holes for PRESET at `path` (created): returns the checkpoint's apparent size in bytes."""
    plan = plan_checkpoint(preset, SHARD_BYTES)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(plan.config, indent=2))
    if plan.preprocessor is not None:
        (path / PREPROCESSOR_FILE).write_text(json.dumps(plan.preprocessor, indent=2))
    write_tokenizer_files(plan.config, path)
    weight_map = {}
    for shard in plan.shards:
        StreamingWriter(path / shard.file, list(shard.tensors), metadata={"format": "pt"}).close()
        weight_map.update({t.name: shard.file for t in shard.tensors})
    if len(plan.shards) > 1:
        index = {"metadata": {"total_size": plan.weight_bytes}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return plan.weight_bytes
