"""Tensor-parallel sharding: which slice of every artifact tensor each of the `tp` ranks holds.

Column-parallel linears split their output rows: q_proj by query heads, k_proj / v_proj by KV heads
(replicated when the model has fewer KV heads than ranks: rank r holds KV head r * kv_heads // tp),
gate_proj / up_proj and the experts' gate / up by the intermediate dim. Row-parallel linears split
their input columns the same way (o_proj by query heads, down_proj and the experts' down by the
intermediate dim), so each rank's output is a partial sum that the graph all-reduces. lm_head, when
it is a tensor of its own (untied, or quantized from tied embeddings) and the vocabulary divides
evenly, splits its rows by vocabulary (`vocab_parallel`): each rank computes V/tp columns of the
logits, gathered by the graph. Everything else (embeddings, norms, q/k norms, the MoE router, a tied
unquantized head that reads the embedding table) is replicated.

A rank's tensor is always an exact slice of the tp=1 tensor, spans concatenated along one axis:
fused tensors concatenate their parts' spans in part order (a qkv_proj rank holds its q rows, then
its k rows, then its v rows). Per-channel and per-tensor scales belong to output rows: they follow a
row split and stay whole under a column split (each row keeps the scale of its whole row). Block
scales follow either split, which must then fall on the block grid. Packed int4 weights (w4a16) follow
a row split as they are, scales with them; a column split must keep whole groups on every rank, and
cuts the packed words (8 columns each) and the group scales at the same places.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from qcompile.compile.jobs import WeightJob
from qcompile.errors import PlanError
from qcompile.quant import QuantScheme
from qcompile.quant.int4 import PER_INT32
from qcompile.quant.schemes import PerBlock, PerGroupInt4
from qcompile.source import model as hf
from qcompile.source.spec import ModelSpec

Spans = tuple[tuple[int, int], ...]  # [begin, end) spans along the split axis, concatenated in order


@dataclass(frozen=True)
class Split:
    """How the `tp` ranks' copies of one tensor are cut from the whole (tp=1) tensor.

    `axis` None: every rank holds the whole tensor. Otherwise rank r holds the spans `ranks[r]` of
    `axis`, concatenated in order; every rank holds the same number of elements along it.
    """

    tp: int
    axis: int | None = None
    ranks: tuple[Spans, ...] = ()

    def __post_init__(self) -> None:
        if self.axis is None:
            if self.ranks:
                raise ValueError("a replicated split has no spans")
            return
        if len(self.ranks) != self.tp:
            raise ValueError(f"a split over {self.tp} ranks needs spans for each of them, got {len(self.ranks)}")
        sizes = {sum(end - begin for begin, end in spans) for spans in self.ranks}
        if len(sizes) != 1 or any(end <= begin for spans in self.ranks for begin, end in spans):
            raise ValueError(f"ranks must hold equal, non-empty slices: {self.ranks}")

    @property
    def replicated(self) -> bool:
        return self.axis is None

    def shape(self, whole: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of each rank's tensor, given the whole tensor's."""
        if self.axis is None:
            return tuple(whole)
        shape = list(whole)
        shape[self.axis] = sum(end - begin for begin, end in self.ranks[0])
        return tuple(shape)

    def take(self, whole: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s tensor cut from the whole tensor."""
        if self.axis is None:
            return whole
        parts = [whole.narrow(self.axis, begin, end - begin) for begin, end in self.ranks[rank]]
        return torch.cat(parts, self.axis) if len(parts) > 1 else parts[0]


def local_heads(spec: ModelSpec, tp: int) -> tuple[int, int]:
    """(query heads, KV heads) each rank computes: num_heads / tp and num_kv_heads / tp, at least one."""
    return spec.num_attention_heads // tp, max(spec.num_key_value_heads // tp, 1)


def vocab_parallel(spec: ModelSpec, tp: int) -> bool:
    """Whether a tp > 1 artifact splits its own lm_head by vocabulary rows (V/tp rows per rank)."""
    return tp > 1 and spec.vocab_size % tp == 0


def check_tp(spec: ModelSpec, tp: int) -> None:
    """PlanError naming the model's key when it cannot be split `tp` ways (heads, intermediate sizes)."""
    if tp == 1:
        return
    heads, kv_heads = spec.num_attention_heads, spec.num_key_value_heads
    if tp > heads:
        raise PlanError(
            f"tp={tp} is more than the model's num_attention_heads ({heads}): every rank needs a query "
            f"head; choose a tp of at most {heads} that divides it"
        )
    if heads % tp:
        raise PlanError(
            f"tp={tp} does not divide the model's num_attention_heads ({heads}); choose a tp that divides it"
        )
    if kv_heads >= tp and kv_heads % tp:
        raise PlanError(
            f"tp={tp} does not divide the model's num_key_value_heads ({kv_heads}); choose a tp that divides it"
        )
    if kv_heads < tp and tp % kv_heads:
        raise PlanError(
            f"tp={tp}: the model's num_key_value_heads ({kv_heads}) is fewer than the ranks and does not divide "
            "tp, so its KV heads cannot be replicated evenly; choose a tp that num_key_value_heads divides "
            "or that divides it"
        )
    sizes = {}
    layers = range(spec.num_hidden_layers)
    if any(not spec.is_sparse_layer(i) for i in layers):
        sizes["intermediate_size"] = spec.intermediate_size
    if spec.moe is not None and any(spec.is_sparse_layer(i) for i in layers):
        sizes["moe_intermediate_size"] = spec.moe.moe_intermediate_size
    for key, size in sizes.items():
        if size % tp:
            raise PlanError(f"tp={tp} does not divide the model's {key} ({size}); choose a tp that divides it")


def _even(size: int, tp: int) -> tuple[Spans, ...]:
    step = size // tp
    return tuple(((r * step, (r + 1) * step),) for r in range(tp))


def source_splits(spec: ModelSpec, tp: int) -> dict[str, tuple[int, tuple[Spans, ...]]]:
    """Source tensor -> (axis of the source, spans of each rank) for every tensor the ranks split;
    the tensors left out are replicated."""
    check_tp(spec, tp)
    d = spec.head_dim
    heads, kv_heads = local_heads(spec, tp)
    q = _even(spec.q_size, tp)
    first_kv = [r * spec.num_key_value_heads // tp for r in range(tp)]  # the first KV head of each rank
    kv = tuple(((h * d, (h + kv_heads) * d),) for h in first_kv)
    out: dict[str, tuple[int, tuple[Spans, ...]]] = {}
    for i in range(spec.num_hidden_layers):
        out[f"{hf.attn_proj(i, 'q_proj')}.weight"] = (0, q)
        out[f"{hf.attn_proj(i, 'k_proj')}.weight"] = (0, kv)
        out[f"{hf.attn_proj(i, 'v_proj')}.weight"] = (0, kv)
        out[f"{hf.attn_proj(i, 'o_proj')}.weight"] = (1, q)
        if spec.is_sparse_layer(i):
            assert spec.moe is not None
            inter = _even(spec.moe.moe_intermediate_size, tp)
            for e in range(spec.moe.num_experts):
                out[f"{hf.expert_proj(i, e, 'gate_proj')}.weight"] = (0, inter)
                out[f"{hf.expert_proj(i, e, 'up_proj')}.weight"] = (0, inter)
                out[f"{hf.expert_proj(i, e, 'down_proj')}.weight"] = (1, inter)
        else:
            inter = _even(spec.intermediate_size, tp)
            out[f"{hf.mlp_proj(i, 'gate_proj')}.weight"] = (0, inter)
            out[f"{hf.mlp_proj(i, 'up_proj')}.weight"] = (0, inter)
            out[f"{hf.mlp_proj(i, 'down_proj')}.weight"] = (1, inter)
    return out


class Sharding:
    """The tensor-parallel layout of one model at degree `tp` (tp=1: everything whole)."""

    def __init__(self, spec: ModelSpec, tp: int) -> None:
        self.tp = tp
        self._sources = source_splits(spec, tp) if tp > 1 else {}
        self._vocab = Split(tp, 0, _even(spec.vocab_size, tp)) if vocab_parallel(spec, tp) else None

    def splits(self, job: WeightJob, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Split]:
        """{tensor name: Split} of the weight (and scale) `job` writes, in the stored tensors' units
        (packed int4: words of 8 columns, groups for the scale).

        Raises PlanError when a block-scaled tensor would be cut off its block grid, an int4 tensor
        inside a group, or when the parts of a fused tensor are split along different axes."""
        weight = self._weight_split(job, shapes)  # in the logical weight's rows and columns
        out = {job.weight_name: _packed_split(job, weight, job.weight_shape(shapes))}
        if job.scale_name is not None:
            out[job.scale_name] = _scale_split(job, weight, job.weight_shape(shapes))
        if job.zero_point_name is not None:  # one per scale: split as the scale is
            out[job.zero_point_name] = out[job.scale_name]
        return out

    def _weight_split(self, job: WeightJob, shapes: Mapping[str, tuple[int, ...]]) -> Split:
        if job.role == "lm_head":  # by its role: its source may be the (replicated) embedding table
            return self._vocab if self._vocab is not None else Split(self.tp)
        found = {src: self._sources.get(src) for src in job.source_names()}
        axes = {None if rule is None else rule[0] for rule in found.values()}
        if axes == {None}:
            return Split(self.tp)
        if len(axes) > 1:
            raise PlanError(
                f"tp={self.tp}: weight {job.weight_name!r} fuses tensors that tensor parallelism splits along "
                "different axes (or splits some and replicates others); remove the fusion pass that makes it"
            )
        (axis,) = axes
        if axis == 1:  # a column split: every part (stacked slice) keeps the same columns
            spans_of = {rule[1] for rule in found.values() if rule is not None}
            if len(spans_of) != 1:
                raise PlanError(f"tp={self.tp}: the parts of weight {job.weight_name!r} would be split differently")
            return Split(self.tp, 1 + int(job.stacked), spans_of.pop())
        layouts = set()
        for group in job.part_rows(shapes):  # a row split: each part's spans, offset to where it sits
            ranks = []
            for r in range(self.tp):
                spans = []
                for source, begin, _ in group:
                    rule = found[source]
                    assert rule is not None
                    spans.extend((begin + b, begin + e) for b, e in rule[1][r])
                ranks.append(tuple(spans))
            layouts.add(tuple(ranks))
        if len(layouts) != 1:
            raise PlanError(f"tp={self.tp}: the slices of weight {job.weight_name!r} would be split differently")
        return Split(self.tp, int(job.stacked), layouts.pop())


def _packed_split(job: WeightJob, weight: Split, weight_shape: tuple[int, ...]) -> Split:
    """The split of the stored weight: the logical one, but for a column split of packed int4, whose
    columns are int32 words of 8 (the cuts fall on whole groups: `_scale_split` checks them)."""
    if weight.axis is None or job.quant.int4 is None or weight.axis != len(weight_shape) - 1:
        return weight
    _check_grid(job, weight, weight_shape, job.quant.int4.group_size)
    return _divided(weight, PER_INT32)


def _scale_split(job: WeightJob, weight: Split, weight_shape: tuple[int, ...]) -> Split:
    """The split of `job`'s scale that keeps every rank's scale the slice belonging to its weight slice."""
    if weight.axis is None:
        return weight
    scheme: QuantScheme = job.quant
    row_axis = len(weight_shape) - 2
    if isinstance(scheme.weights, PerGroupInt4):  # one scale per row and group of columns
        if weight.axis == row_axis:
            return weight
        _check_grid(job, weight, weight_shape, scheme.weights.group_size)
        return _divided(weight, scheme.weights.group_size)
    if not isinstance(scheme.weights, PerBlock):
        return weight if weight.axis == row_axis else Split(weight.tp)  # per-row scales: whole rows kept
    block = scheme.weights.block_n if weight.axis == row_axis else scheme.weights.block_k
    _check_grid(job, weight, weight_shape, block)
    return _divided(weight, block)


def _divided(split: Split, size: int) -> Split:
    """`split` in units of `size` (a last partial unit counts whole)."""
    return Split(split.tp, split.axis, tuple(tuple((b // size, -(-e // size)) for b, e in s) for s in split.ranks))


def _check_grid(job: WeightJob, weight: Split, weight_shape: tuple[int, ...], block: int) -> None:
    """PlanError unless every cut of `weight` falls on a multiple of `block` (or the tensor's end)."""
    scheme: QuantScheme = job.quant
    size = weight_shape[weight.axis]
    what = "rows" if weight.axis == len(weight_shape) - 2 else "columns"
    for spans in weight.ranks:
        for index, (begin, end) in enumerate(spans):
            last = index == len(spans) - 1 and end == size
            cut = begin if begin % block else end if end % block and not last else None
            if cut is None:
                continue
            if scheme.int4:
                local = sum(e - b for b, e in spans)
                first = job.sources[0][0].removesuffix(".weight")
                also = " and the modules fused or stacked with it" if job.stacked or len(job.sources[0]) > 1 else ""
                raise PlanError(
                    f"tp={weight.tp}: {job.weight_name} would be split between columns {cut - 1} and {cut}, inside "
                    f"a {block}-column int4 group of scheme {scheme.name!r}: each rank holds {local} of its "
                    f"{size} input columns, not a whole number of groups. Choose a tp that leaves each rank a "
                    f"multiple of {block} columns, or keep {first!r}{also} unquantized (quantization.ignore)"
                )
            raise PlanError(
                f"tp={weight.tp}: {job.weight_name} would be split between {what} {cut - 1} and {cut}, inside a "
                f"{block}-wide weight block of scheme {scheme.name!r}: block-scaled weights split only on "
                f"multiples of {block}. Choose a smaller tp, or a per-channel scheme such as ptpc-fp8"
            )
