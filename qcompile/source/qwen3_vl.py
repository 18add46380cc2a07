"""A Qwen3-VL checkpoint's tensors under the names the compiler reads (docs/vision.md, "Artifacts").

Qwen3VL(Moe)ForConditionalGeneration stores its text decoder under `model.language_model.`, its head as
`lm_head.weight` and its vision tower under `model.visual.`. `text_view` maps the stored headers to
Qwen3's names, as data (RENAMES, STACKED):

- `model.language_model.X` is read as `model.X`; `lm_head.weight` and `model.visual.*` keep their names;
- a sparse layer's stacked experts, `mlp.experts.gate_up_proj` [E, 2I, H] (transformers' layout) or
  [E, H, 2I] (the published checkpoints') and `mlp.experts.down_proj` [E, H, I] or [E, I, H], are read
  as the per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` of Qwen3-MoE (gate: the first I rows of
  gate_up). A shape equal to transformers' layout is taken as it is (as transformers does).

Every entry of the view is a TensorEntry (its `read_rows` returns the Qwen3 tensor's rows), so the
writer, the passes and tp sharding read it as they read a Qwen3 checkpoint's. Errors name the stored tensor.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from qruntime.shown import shown
from qruntime.vision.tower_config import VisionTowerConfig
from qruntime.vision.tower_weights import tower_tensor_shapes

from qcompile.errors import CheckpointError
from qcompile.io.safetensors_stream import TensorEntry
from qcompile.source.model import expert_proj
from qcompile.source.spec import ModelSpec

TOWER_PREFIX = "model.visual."  # kept as stored; written by the tower's own job, not the text graph's
# stored prefix -> the prefix the compiler reads it under (first match wins); None: the name as stored
RENAMES: tuple[tuple[str, str | None], ...] = (
    ("model.language_model.", "model."),
    (TOWER_PREFIX, None),
    ("lm_head.weight", None),
)
# stacked expert tensor -> the projections it holds, stacked along transformers' dim 1, each
# projection's (rows, cols) in transformers' layout as a function of (I, H)
STACKED: Mapping[str, tuple[str, ...]] = {
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_STACKED_NAME = re.compile(r"model\.language_model\.layers\.(\d{1,10})\.mlp\.experts\.(gate_up_proj|down_proj)")


@dataclass(frozen=True)
class RenamedEntry(TensorEntry):
    """A stored tensor, or a contiguous slice of one, read under a Qwen3 name (`name`)."""

    stored_name: str

    def describe(self) -> str:
        return f"{shown(self.stored_name, 120)} (read as {self.name!r})"


@dataclass(frozen=True)
class TransposedExpert(RenamedEntry):
    """One expert's projection in a stacked tensor stored transposed: its [cols, rows] block sits in
    columns `column`.. of the expert's contiguous [cols, stored columns] slice (begin..end). A row
    range reads that whole slice (one expert's matrix) and transposes the columns it needs."""

    column: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        rows, cols = self.shape
        stored_cols = (self.end - self.begin) // (cols * self.torch_dtype.itemsize)
        whole = TensorEntry(self.stored_name, self.file, self.dtype, (cols, stored_cols), self.begin, self.end)
        block = whole.read_rows(0, cols)[:, self.column + start : self.column + stop]
        return block.T.contiguous()


def label(name: str, entry: object, plain: Callable[[str], str] = repr) -> str:
    """How errors name tensor `name` of the view: a renamed one by its stored name and the name it is
    read as, any other as `plain` shows it."""
    return entry.describe() if isinstance(entry, RenamedEntry) else plain(name)


def stored_name(name: str) -> str:
    """The stored tensor a Qwen3 name of a Qwen3-VL checkpoint is read from (for errors about a missing one)."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight", name)
    if match:
        stacked = "down_proj" if match.group(2) == "down" else "gate_up_proj"
        return f"model.language_model.layers.{match.group(1)}.mlp.experts.{stacked}"
    if name.startswith("model.") and not name.startswith(TOWER_PREFIX):
        return "model.language_model." + name[len("model.") :]
    return name


def tower_expected(spec: ModelSpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every vision tower tensor of a Qwen3-VL spec (none for a Qwen3 one)."""
    if spec.vision is None:
        return
    tower = VisionTowerConfig.from_dict(json.loads(spec.vision.tower_config))
    for name, shape in tower_tensor_shapes(tower).items():
        yield TOWER_PREFIX + name, shape


def tower_count(spec: ModelSpec) -> int:
    return sum(1 for _ in tower_expected(spec))


def text_view(spec: ModelSpec, stored: Mapping[str, TensorEntry]) -> dict[str, TensorEntry]:
    """The stored tensors of a Qwen3-VL checkpoint under the names the compiler reads (module docstring).
    CheckpointError naming the stored tensor for one outside RENAMES, a stacked expert tensor of the
    wrong shape or in a dense model, and two stored tensors read under one name."""
    view: dict[str, TensorEntry] = {}
    for name, entry in stored.items():
        match = _STACKED_NAME.fullmatch(name)
        parts = _experts(spec, int(match.group(1)), match.group(2), entry) if match else [_renamed(spec, entry)]
        for part in parts:
            if part.name in view:
                raise CheckpointError(
                    f"{entry.file.name}: {label(part.name, part)} and {label(part.name, view[part.name])} are "
                    "the same tensor of the model; a checkpoint holds it once"
                )
            view[part.name] = part
    return view


def _renamed(spec: ModelSpec, entry: TensorEntry) -> TensorEntry:
    for prefix, target in RENAMES:
        if entry.name.startswith(prefix):
            if target is None:
                return entry
            name = target + entry.name[len(prefix) :]
            return RenamedEntry(name, entry.file, entry.dtype, entry.shape, entry.begin, entry.end, entry.name)
    raise CheckpointError(
        f"{entry.file.name}: unexpected tensor {shown(entry.name)} for {spec.architecture}: its tensors are "
        f"named {', '.join(p + '*' if p.endswith('.') else p for p, _ in RENAMES)}"
    )


def _experts(spec: ModelSpec, layer: int, stacked: str, entry: TensorEntry) -> list[TensorEntry]:
    """The per-expert projections of one stacked expert tensor, checked against the config's sizes."""
    if spec.moe is None:
        raise CheckpointError(
            f"{entry.file.name}: unexpected tensor {shown(entry.name)}: config.json describes a dense model "
            f"({spec.architecture}), without experts"
        )
    e, inter, h = spec.moe.num_experts, spec.moe.moe_intermediate_size, spec.hidden_size
    projs = STACKED[stacked]
    rows = inter if stacked != "down_proj" else h  # one projection's rows in transformers' layout
    cols = h if stacked != "down_proj" else inter
    own = (e, rows * len(projs), cols)
    published = (e, cols, rows * len(projs))
    if entry.shape not in (own, published):
        raise CheckpointError(
            f"{entry.file.name}: tensor {entry.name!r} has shape {list(entry.shape)}, config.json implies "
            f"{list(own)} (or {list(published)} stored transposed), from 'num_experts', 'moe_intermediate_size' "
            "and 'hidden_size'"
        )
    itemsize = entry.torch_dtype.itemsize
    per_expert = entry.nbytes // e
    parts: list[TensorEntry] = []
    for expert in range(e):
        base = entry.begin + expert * per_expert
        for k, proj in enumerate(projs):
            name = f"{expert_proj(layer, expert, proj)}.weight"
            if entry.shape == own:  # the projection is a contiguous block of rows
                begin = base + k * rows * cols * itemsize
                end = begin + rows * cols * itemsize
                parts.append(RenamedEntry(name, entry.file, entry.dtype, (rows, cols), begin, end, entry.name))
            else:
                parts.append(
                    TransposedExpert(
                        name, entry.file, entry.dtype, (rows, cols), base, base + per_expert, entry.name, k * rows
                    )
                )
    return parts
