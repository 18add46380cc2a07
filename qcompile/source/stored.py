"""The quantized linears of a pre-quantized checkpoint: found in the shard headers, checked, read row by row.

`collect_stored` groups a checkpoint's tensors by module under its StoredFormat (qcompile.source.quantized):
each quantized linear becomes a StoredWeight under its logical source name (`{module}.weight`, the
name a bf16 checkpoint gives it) with its logical [rows, cols]; every other tensor stays as it is. It
proves, from the headers alone, that every quantized linear has each of its tensors once with the
dtype and shape its logical shape implies, that the config's ignore list and the tensors agree, and
that nothing else is stored quantized. `StoredWeight.read_rows` then reads a row range of the weight
and its scales as the artifact stores them, refusing NaN/Inf, zero and negative scales and FP8 NaN codes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from qruntime.shown import shown

from qcompile.errors import CheckpointError, RecipeError, TensorValueError
from qcompile.io.safetensors_stream import DTYPE_NAMES, TensorEntry
from qcompile.quant import int4
from qcompile.quant.fp8 import FP8_DTYPE
from qcompile.recipe.ignore_list import IgnoreList
from qcompile.source import awq
from qcompile.source.model import EMBED, LM_HEAD, expected_tensors
from qcompile.source.spec import ModelSpec
from qcompile.source.stored_format import AWQ_GEMM, StoredFormat

_INDEX_DTYPES = ("I64", "I32")  # compressed-tensors writes weight_shape as int64, weight_g_idx as int32
_FP8_NAN = 0x7F  # e4m3fn has no Inf; S.1111.111 is its NaN


@dataclass(frozen=True)
class StoredWeight:
    """One linear weight the checkpoint stores quantized, its tensors checked against its logical shape."""

    name: str  # the logical source name, `{module}.weight`
    shape: tuple[int, int]  # logical [rows, cols]
    weight: TensorEntry  # FP8 [rows, cols] or packed int32 [rows, cols / 8] (AutoAWQ: [cols, rows / 8])
    scale: TensorEntry
    format: StoredFormat
    aux: tuple[TensorEntry, ...] = ()
    zero_point: TensorEntry | None = None  # asymmetric int4: packed int32 zero points

    @property
    def file(self) -> Path:
        return self.weight.file

    @property
    def row_bytes(self) -> int:
        """Bytes of one logical weight row as stored (what a chunk of rows reads, scales aside)."""
        return self.weight.nbytes // self.shape[0]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def entries(self) -> tuple[TensorEntry, ...]:
        return (self.weight, self.scale, *self.aux, *([self.zero_point] if self.zero_point is not None else []))

    def read_rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Stored weight rows [start, stop), their scales and (asymmetric int4) zero-point codes as the
        artifact holds them: per-tensor scales repeated on each row ([rows, 1]), block scales the bands
        the rows cover (`start` a multiple of the block), zero points uint8 [rows, groups]. An AutoAWQ
        linear is read whole (its rows are its tensors' columns) and transposed. TensorValueError naming
        the tensor on a NaN/Inf, zero or negative scale or an FP8 NaN."""
        quant = self.format.quant
        zero_point = None
        if self.format.layout == AWQ_GEMM:
            assert self.zero_point is not None
            weight, scale, zero_point = awq.to_rows(
                self.weight.read(), self.scale.read(), self.zero_point.read(), start, stop
            )
            self._check_scales(scale.T, start, transposed=True)
            return weight, scale, zero_point
        weight = self.weight.read_rows(start, stop)
        if self.zero_point is not None:  # rows packed eight to a word (compressed-tensors)
            first = start // int4.PER_INT32
            words = self.zero_point.read_rows(first, -(-stop // int4.PER_INT32))
            zero_point = int4.unpack_rows_int4(words, stop - first * int4.PER_INT32)[start - first * int4.PER_INT32 :]
        if quant.per_tensor:
            scale = self.scale.read().reshape(1, 1).expand(stop - start, 1).contiguous()
        elif quant.row_align > 1:
            align = quant.row_align
            scale = self.scale.read_rows(start // align, -(-stop // align))
        else:
            scale = self.scale.read_rows(start, stop)
        self._check_scales(scale, start)
        # e4m3fn's NaN has every exponent and mantissa bit set: the masked bytes' max finds one (a
        # max is ~20x faster than comparing every byte on a CPU; the index is looked for only then)
        if (
            weight.dtype == FP8_DTYPE
            and weight.numel()
            and int((weight.view(torch.uint8) & _FP8_NAN).amax()) == _FP8_NAN
        ):
            nan = (weight.view(torch.uint8) & _FP8_NAN) == _FP8_NAN
            index = [int(i) for i in nan.nonzero()[0]]
            index[0] += start
            raise TensorValueError(
                f"{self.weight.file.name}: tensor {self.weight.name!r} holds an FP8 NaN at index {index} "
                "(the checkpoint is corrupt)"
            )
        return weight, scale, zero_point

    def _check_scales(self, scale: torch.Tensor, start: int, transposed: bool = False) -> None:
        """TensorValueError naming the scale tensor and the index of a NaN/Inf, zero or negative scale in
        `scale`, the stored tensor's rows (columns when `transposed`) from `start` on."""
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if not bool(bad.any()):
            return
        quant = self.format.quant
        index = [int(i) for i in bad.nonzero()[0]]
        value = scale[tuple(index)].item()
        if quant.per_tensor:
            index = [0]
        elif transposed:
            index = [index[0], index[1] + start]
        else:
            index = [index[0] + start // quant.row_align, *index[1:]]
        raise TensorValueError(
            f"{self.scale.file.name}: tensor {self.scale.name!r} holds {value} at index {index}; every scale "
            "must be a finite positive number (the checkpoint is corrupt)"
        )


def linear_modules(spec: ModelSpec) -> list[str]:
    """The linear layers of `spec` in checkpoint order: every 2-D weight's module but the embedding, and lm_head."""
    expected = expected_tensors(spec)
    modules = [n.removesuffix(".weight") for n, shape in expected.items() if len(shape) == 2 and n != f"{EMBED}.weight"]
    return modules if LM_HEAD in modules else [*modules, LM_HEAD]


def collect_stored(
    spec: ModelSpec, tensors: Mapping[str, TensorEntry], fmt: StoredFormat
) -> tuple[dict[str, StoredWeight], dict[str, TensorEntry]]:
    """({logical name: StoredWeight}, {name: entry} of every other tensor) of a pre-quantized checkpoint.

    Each StoredWeight's tensors are checked against one another (its logical shape is its stored
    weight's) from the headers alone, in time linear in the number of tensors; config.json's sizes
    are held to the logical shapes afterwards, as a bf16 checkpoint's are to its tensors, and then
    `check_unquantized` checks the linears left in the model dtype. Errors name the shard file and tensor."""
    modules = _quantized_modules(tensors, fmt)
    ignore = _ignore_list(fmt)
    model_dtype = DTYPE_NAMES[getattr(torch, spec.dtype)]
    stored: dict[str, StoredWeight] = {}
    for module, first in modules.items():
        if module == EMBED or (module == LM_HEAD and spec.tie_word_embeddings):
            what = (
                "the embedding" if module == EMBED else "the output projection of a tied model (it reads the embedding)"
            )
            raise CheckpointError(
                f"{first.file.name}: tensor {shown(first.name)} stores {shown(module)} quantized, but that is {what}; "
                "qcompile reads it in the model dtype only (re-export the checkpoint with it in 'ignore')"
            )
        stored[f"{module}.weight"] = _stored_weight(module, first, tensors, fmt, model_dtype)
        if _ignored(ignore, module):
            raise CheckpointError(
                f"{first.file.name}: {module} is stored quantized ({first.name}), but config.json's "
                "quantization_config lists it in 'ignore' (left unquantized): the config and the tensors disagree"
            )
    consumed = {e.name for s in stored.values() for e in s.entries()}
    plain = {name: entry for name, entry in tensors.items() if name not in consumed}
    return stored, plain


def check_unquantized(
    spec: ModelSpec, tensors: Mapping[str, TensorEntry], stored: Mapping[str, StoredWeight], fmt: StoredFormat
) -> None:
    """Every linear the checkpoint keeps in the model dtype is one its config leaves unquantized: in
    the 'ignore' list, an MoE router (no nn.Linear in transformers: llm-compressor leaves it as it is)
    or a tied lm_head. Call once config.json's sizes are held to the tensors (it lists every linear)."""
    ignore = _ignore_list(fmt)
    for module in linear_modules(spec):
        name = f"{module}.weight"
        if name in stored or name not in tensors or module.endswith(".mlp.gate") or _ignored(ignore, module):
            continue
        entry = tensors[name]
        raise CheckpointError(
            f"{entry.file.name}: tensor {name!r} is {entry.dtype} with no {module}.{fmt.scale_key}, but "
            f"config.json's quantization_config quantizes every Linear not in its 'ignore' list "
            f"({fmt.describe()}): expected {module}.{fmt.weight_key} and {module}.{fmt.scale_key}"
        )


def _ignore_list(fmt: StoredFormat) -> IgnoreList:
    try:
        return IgnoreList(fmt.ignore, key="config.json quantization_config.ignore")
    except RecipeError as exc:
        raise CheckpointError(str(exc)) from exc


def _ignored(ignore: IgnoreList, module: str) -> bool:
    try:
        return ignore.matches(module)
    except RecipeError as exc:
        raise CheckpointError(str(exc)) from exc


def _quantized_modules(tensors: Mapping[str, TensorEntry], fmt: StoredFormat) -> dict[str, TensorEntry]:
    """module -> the first of its tensors that marks it quantized: a scale, an aux tensor, a packed or
    FP8 weight (an FP8 `weight` is quantized whatever its neighbours)."""
    keys = {fmt.scale_key, *fmt.aux_keys} | ({fmt.weight_key} if fmt.weight_key != "weight" else set())
    keys |= {fmt.zero_point_key} if fmt.zero_point_key else set()
    modules: dict[str, TensorEntry] = {}
    for name, entry in tensors.items():
        module, _, key = name.rpartition(".")
        if key in keys or (key == "weight" and entry.dtype.startswith("F8_")):
            modules.setdefault(module, entry)
    return modules


def _stored_weight(
    module: str, first: TensorEntry, tensors: Mapping[str, TensorEntry], fmt: StoredFormat, model_dtype: str
) -> StoredWeight:
    """The StoredWeight of `module` (whose tensor `first` marks it quantized), its tensors checked
    against its weight's shape (the logical shape: for packed int4, 8 columns an int32)."""

    def need(key: str, dtypes: tuple[str, ...]) -> TensorEntry:
        name = f"{module}.{key}"
        entry = tensors.get(name)
        if entry is None:
            raise CheckpointError(
                f"tensor {name!r} is missing from the checkpoint: {first.file.name} holds {first.name!r}, and "
                f"{fmt.describe()} stores every quantized linear as "
                + " + ".join(f"{module}.{k}" for k in (fmt.weight_key, fmt.scale_key, *fmt.aux_keys))
            )
        if entry.dtype not in dtypes:
            why = ""
            if key == fmt.scale_key and entry.dtype in DTYPE_NAMES.values():
                why = (
                    f" (the model dtype, config.json's torch_dtype: scales in another float type would change "
                    f"the weights when converted; a {entry.dtype} checkpoint says so in config.json)"
                )
            raise CheckpointError(
                f"{entry.file.name}: tensor {name!r} is {entry.dtype}; {fmt.method} {fmt.format} stores it as "
                f"{' or '.join(dtypes)}{why}"
            )
        return entry

    def check_shape(entry: TensorEntry, want: tuple[int, ...]) -> None:
        if entry.shape != tuple(want):
            raise CheckpointError(
                f"{entry.file.name}: tensor {entry.name!r} has shape {list(entry.shape)}; {fmt.method} {fmt.format} stores it as "
                f"{list(want)} for a linear of {list(shape)} ({weight.name} is {list(weight.shape)})"
            )

    weight = need(fmt.weight_key, ("I32",) if fmt.quant.int4 else (DTYPE_NAMES[FP8_DTYPE],))
    if len(weight.shape) != 2 or 0 in weight.shape:
        raise CheckpointError(
            f"{weight.file.name}: tensor {weight.name!r} has shape {list(weight.shape)}; a quantized linear's "
            "weight is 2-D [rows, columns]"
        )
    shape = fmt.logical_shape(weight.shape)
    scale = need(fmt.scale_key, (model_dtype,))
    check_shape(scale, fmt.scale_shape(shape))
    aux = tuple(need(key, _INDEX_DTYPES) for key in fmt.aux_keys)
    for entry in aux:
        _check_aux(entry, shape, weight, fmt, check_shape)
    zero_point = None
    if fmt.zero_point_key is not None:
        zero_point = need(fmt.zero_point_key, ("I32",))
        check_shape(zero_point, fmt.zero_point_shape(shape))
    if fmt.weight_key != "weight" and f"{module}.weight" in tensors:
        raise CheckpointError(
            f"{tensors[f'{module}.weight'].file.name}: tensor {module + '.weight'!r} is stored beside "
            f"{weight.name!r}; a quantized linear holds its weight once"
        )
    return StoredWeight(f"{module}.weight", shape, weight, scale, fmt, aux, zero_point)


def _check_aux(
    entry: TensorEntry,
    shape: tuple[int, int],
    weight: TensorEntry,
    fmt: StoredFormat,
    check_shape: Callable[[TensorEntry, tuple[int, ...]], None],
) -> None:
    """A packed int4 linear's other tensors, read (a few bytes each) and checked: `weight_shape`, the
    logical [rows, cols]; `weight_g_idx` (act-order 'group'), each input column's group, which must
    be the in-order one (column j in group j // group_size), the only order the int4 layout runs."""
    key = entry.name.rpartition(".")[2]
    if key == "weight_shape":
        check_shape(entry, (2,))
        held = [int(v) for v in entry.read()]
        if held != list(shape):
            raise CheckpointError(
                f"{entry.file.name}: tensor {entry.name!r} holds {held}, but {weight.name} {list(weight.shape)} "
                f"holds a linear of {list(shape)}"
            )
        return
    if key == "weight_g_idx":
        check_shape(entry, (shape[1],))
        assert fmt.quant.int4 is not None
        group = fmt.quant.int4.group_size
        g_idx = entry.read().to(torch.int64)
        wrong = (g_idx != torch.arange(shape[1]) // group).nonzero()
        if len(wrong):
            column = int(wrong[0])
            raise CheckpointError(
                f"{entry.file.name}: tensor {entry.name!r} puts input column {column} in group {int(g_idx[column])}, "
                f"not {column // group}: act-order 'group' orders the groups by activation, and the int4 layout "
                f"qcompile runs keeps each group's {group} columns together in order (reordering them would need "
                "the activations reordered too). Quantize with actorder 'weight' (static), stored in order, or "
                "without act-order"
            )
        return
    raise ValueError(f"{fmt.method}: no check for {key!r}")  # pragma: no cover - a format names only these
