"""Write a complete random-weight Hugging Face checkpoint for a preset or a config dict.

The directory holds what a published Qwen3 checkpoint holds: config.json, safetensors shards
(`model.safetensors`, or `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`),
tokenizer.json, tokenizer_config.json, special_tokens_map.json and generation_config.json (and a
Qwen3-VL model's preprocessor_config.json). It
appears at its path only when complete (`atomic_output_dir`).
"""

from __future__ import annotations

import errno
import json
import math
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qcompile.compile.plan import Shard
from qcompile.errors import ArtifactError
from qcompile.io.atomic import atomic_output_dir, check_target
from qcompile.io.safetensors_stream import OutputTensor
from qcompile.source.checkpoint import INDEX_FILE, SINGLE_FILE
from qcompile.source.spec import ModelSpec
from qcompile.synth.presets import Preset, get_preset
from qcompile.synth.tokenizer import write_tokenizer_files
from qcompile.synth.vl_presets import published_preprocessor
from qcompile.synth.vl_tensors import checkpoint_tensors
from qcompile.synth.weights import Progress, write_shard
from qcompile.units import human_bytes

DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # Hugging Face's "5GB" default
PREPROCESSOR_FILE = "preprocessor_config.json"
SIDE_FILES_ALLOWANCE = 64 << 20  # config, tokenizer (~6 MB at Qwen's vocab size), headers, slack


@dataclass(frozen=True)
class CheckpointPlan:
    """What `write_checkpoint` will write, known before a byte is written."""

    config: dict[str, Any]
    spec: ModelSpec
    shards: tuple[Shard, ...]
    preprocessor: dict[str, Any] | None = None  # preprocessor_config.json of a Qwen3-VL model

    @property
    def parameters(self) -> int:
        return sum(math.prod(t.shape) for s in self.shards for t in s.tensors)

    @property
    def weight_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def weight_map(self) -> dict[str, str]:
        """Tensor name -> shard file, sorted by name as Hugging Face writes it."""
        return dict(sorted((t.name, s.file) for s in self.shards for t in s.tensors))


@dataclass(frozen=True)
class SynthResult:
    """What was written: where, how many parameters, how many weight bytes, in how many files."""

    path: Path
    parameters: int
    weight_bytes: int
    shards: int
    seed: int


def resolve_config(preset_or_config: str | Preset | Mapping[str, Any]) -> dict[str, Any]:
    """A fresh config dict from a preset name, a Preset or a config mapping (copied)."""
    if isinstance(preset_or_config, str):
        return get_preset(preset_or_config).config()
    if isinstance(preset_or_config, Preset):
        return preset_or_config.config()
    return json.loads(json.dumps(dict(preset_or_config)))


def plan_checkpoint(
    preset_or_config: str | Preset | Mapping[str, Any], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> CheckpointPlan:
    """Validate the config into a ModelSpec and pack its tensors into shards of at most
    `max_shard_bytes` (a tensor larger than that gets a shard of its own)."""
    if max_shard_bytes <= 0:
        raise ArtifactError(f"the maximum shard size must be positive, got {max_shard_bytes} bytes")
    config = resolve_config(preset_or_config)
    spec = ModelSpec.from_config(config, source="synth config")
    dtype: torch.dtype = getattr(torch, spec.dtype)
    groups: list[list[OutputTensor]] = [[]]
    size = 0
    for name, shape in checkpoint_tensors(spec).items():
        tensor = OutputTensor(name, dtype, shape)
        if groups[-1] and size + tensor.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    if len(groups) == 1:
        shards = (Shard(SINGLE_FILE, tuple(groups[0])),)
    else:
        count = len(groups)
        shards = tuple(
            Shard(f"model-{i:05d}-of-{count:05d}.safetensors", tuple(group)) for i, group in enumerate(groups, 1)
        )
    return CheckpointPlan(config, spec, shards, _preprocessor(preset_or_config, config))


def _preprocessor(preset_or_config: str | Preset | Mapping[str, Any], config: dict[str, Any]) -> dict[str, Any] | None:
    """A vision model's preprocessor_config.json: its preset's, else the published one with the
    tower's patch sizes; None for a text model."""
    if "vision_config" not in config:
        return None
    preset = get_preset(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    if isinstance(preset, Preset) and preset.preprocessor() is not None:
        return preset.preprocessor()
    return published_preprocessor(config["vision_config"])


def check_free_space(target: Path, needed: int) -> None:
    """Refuse before writing when the file system holding `target` has less than `needed` bytes free."""
    probe = target.absolute()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise ArtifactError(
            f"{target}: needs {human_bytes(needed)} of free disk space but only {human_bytes(free)} is free on the "
            f"file system holding {probe}; free some space or choose another output directory"
        )


def preflight(plan: CheckpointPlan, target: Path, force: bool) -> None:
    """Every check that can fail before writing starts: the target, then the free disk space."""
    check_target(target.absolute(), force)
    check_free_space(target, plan.weight_bytes + SIDE_FILES_ALLOWANCE)


def write_checkpoint(
    preset_or_config: str | Preset | Mapping[str, Any],
    out_dir: str | Path,
    seed: int = 0,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: Progress | None = None,
    force: bool = False,
    threads: int | None = None,
) -> SynthResult:
    """Write a random-weight checkpoint of a preset (by name) or a config dict at `out_dir`.

    Values are a deterministic function of `seed`; `progress` is called with each chunk's byte
    count as it lands. An existing `out_dir` is refused unless `force`, and is then replaced only
    once the new checkpoint is complete. Raises ArtifactError when the disk is too small.
    """
    target = Path(out_dir)
    plan = plan_checkpoint(preset_or_config, max_shard_bytes)
    preflight(plan, target, force)
    with atomic_output_dir(target, force) as tmp:
        _write_json(tmp / "config.json", plan.config)
        if plan.preprocessor is not None:
            _write_json(tmp / PREPROCESSOR_FILE, plan.preprocessor)
        write_tokenizer_files(plan.config, tmp)
        try:
            for shard in plan.shards:
                write_shard(tmp / shard.file, list(shard.tensors), seed, progress, threads)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise ArtifactError(f"{target}: the disk filled up while writing ({exc})") from exc
            raise
        if len(plan.shards) > 1:
            index = {"metadata": {"total_size": plan.weight_bytes}, "weight_map": plan.weight_map()}
            _write_json(tmp / INDEX_FILE, index)
    return SynthResult(target.absolute(), plan.parameters, plan.weight_bytes, len(plan.shards), seed)


def _write_json(path: Path, content: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
