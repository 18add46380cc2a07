"""GraphBuilder: the scratchpad `build_graph` emits nodes, values and weight jobs into."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property

import numpy as np
import torch

from qcompile.compile.jobs import WeightJob
from qcompile.compile.kvcache import KVScales
from qcompile.errors import PlanError
from qcompile.graph.ir import AttrValue, Dim, Graph, Node, TensorType, check_graph, constant_name
from qcompile.graph.ops import OP_DOMAINS
from qcompile.quant import QuantScheme, get_scheme
from qcompile.quant.fp8 import FP8_DTYPE
from qcompile.quant.int4 import check_groups
from qcompile.recipe.schema import Recipe
from qcompile.source.model import expected_tensors
from qcompile.source.spec import ModelSpec

Output = tuple[str, TensorType]


class GraphBuilder:
    """Accumulates one graph; used by a single `build_graph` call and then dropped."""

    def __init__(self, spec: ModelSpec, recipe: Recipe, kv_scales: KVScales | None = None) -> None:
        self.spec = spec
        self.recipe = recipe
        self.tp = recipe.tp  # > 1: the graph of one rank, sizes its share of the heads and intermediate dims
        self.kv_scales = kv_scales  # calibrated fp8 KV scales, per layer (None: 1.0)
        self.dtype: torch.dtype = getattr(torch, spec.dtype)
        self.nodes: list[Node] = []
        self.types: dict[str, TensorType] = {}
        self.inputs: list[str] = []
        self.weights: dict[str, WeightJob] = {}
        self.constants: dict[str, np.ndarray] = {}
        self._quantized: dict[tuple[str, int], tuple[str, str]] = {}

    # --- values ------------------------------------------------------------------------------------
    def input(self, name: str, dtype: torch.dtype, shape: tuple[Dim, ...]) -> str:
        self.inputs.append(name)
        self.types[name] = TensorType(dtype, shape)
        return name

    def shape(self, value: str) -> tuple[Dim, ...]:
        return self.types[value].shape

    def act(self, name: str, shape: tuple[Dim, ...], dtype: torch.dtype | None = None) -> Output:
        """An output value spec; the model dtype unless `dtype` is given."""
        return name, TensorType(dtype or self.dtype, shape)

    def constant(self, values: Sequence[int]) -> str:
        """An int64 1-D constant named by its content."""
        name = constant_name(list(values))
        self.constants[name] = np.asarray(values, dtype=np.int64)
        return name

    # --- nodes -------------------------------------------------------------------------------------
    def node(
        self,
        op_type: str,
        inputs: Sequence[str],
        outputs: Sequence[Output],
        attrs: Mapping[str, AttrValue] | None = None,
        name: str | None = None,
    ) -> tuple[str, ...]:
        """Append a node (domain from the contract); returns its output names."""
        for out, tensor_type in outputs:
            if out in self.types:
                raise ValueError(f"value {out!r} is produced twice")
            self.types[out] = tensor_type
        names = tuple(out for out, _ in outputs)
        self.nodes.append(Node(op_type, OP_DOMAINS[op_type], tuple(inputs), names, attrs or {}, name or names[0]))
        return names

    def job(self, name: str, sources: tuple[tuple[str, ...], ...], scheme: str, role: str) -> WeightJob:
        if name in self.weights:
            raise ValueError(f"weight job {name!r} is declared twice")
        job = WeightJob(name, sources, stacked=False, scheme=scheme, role=role)
        self.weights[name] = job
        return job

    def scheme_of(self, module: str) -> QuantScheme:
        """The scheme of linear `module`: the recipe's unless its ignore list keeps the module unquantized."""
        return get_scheme("none" if self.recipe.ignores(module) else self.recipe.quantization.scheme)

    def quantize(self, x: str, group_size: int) -> tuple[str, str]:
        """DynamicQuant of `x` (one per value and group size, shared by every linear reading it).

        group_size 0: one scale per token; n > 0: per n channels of a token; -1: one scale for the
        whole step, repeated on every token's row (xs [T, 1], as per-token)."""
        key = (x, group_size)
        if key not in self._quantized:
            rows, cols = self.shape(x)
            groups = 1 if group_size <= 0 else -(-int(cols) // group_size)
            xq, xs = self.node(
                "DynamicQuant",
                [x],
                [self.act(f"{x}.q", (rows, cols), FP8_DTYPE), self.act(f"{x}.scale", (rows, groups), torch.float32)],
                {"group_size": group_size},
                name=f"{x}.quant",
            )
            self._quantized[key] = (xq, xs)
        return self._quantized[key]

    def linear(
        self, x: str, module: str, out_features: int, out: str, role: str = "linear", source: str | None = None
    ) -> str:
        """y = x Wᵀ for linear `module` (job named after it, reading `source`, default `module.weight`)."""
        scheme = self.scheme_of(module)
        job = self.job(module, ((source or f"{module}.weight",),), scheme.name, role)
        rows = self.shape(x)[0]
        if not scheme.quantized:
            return self.gemm(x, job.weight_name, out_features, out, name=module)
        assert job.scale_name is not None
        if scheme.int4 is not None:  # weight-only: x stays in the model dtype
            self._check_groups(job, scheme, int(self.shape(x)[1]))
            return self.node(
                scheme.linear_op,
                [x, *job.quant_names],
                [self.act(out, (rows, out_features))],
                {"group_size": scheme.int4.group_size},
                name=module,
            )[0]
        xq, xs = self.quantize(x, scheme.activation_group)
        attrs: dict[str, AttrValue] = {}
        if scheme.row_align > 1:
            attrs = {"block_n": scheme.weights.block_n, "block_k": scheme.weights.block_k}  # type: ignore[union-attr]
        return self.node(
            scheme.linear_op,
            [xq, xs, job.weight_name, job.scale_name],
            [self.act(out, (rows, out_features))],
            attrs,
            name=module,
        )[0]

    @cached_property
    def _source_shapes(self) -> dict[str, tuple[int, ...]]:
        return expected_tensors(self.spec)

    def _check_groups(self, job: WeightJob, scheme: QuantScheme, local_cols: int) -> None:
        """PlanError naming the source tensor when its input columns (or, at tp > 1, a rank's share of
        them, `local_cols`) are not whole int4 groups."""
        assert scheme.int4 is not None
        group = scheme.int4.group_size
        (source,) = job.sources[0]
        shape = self._source_shapes[source]
        try:
            check_groups(shape, group, source)
        except ValueError as exc:
            raise PlanError(f"recipe {self.recipe.name!r}: {exc}") from None
        if local_cols % group:
            raise PlanError(
                f"recipe {self.recipe.name!r}: tp={self.tp} gives each rank {local_cols} of the {shape[1]} input "
                f"columns of {source}, not a whole number of {group}-column int4 groups (scheme {scheme.name!r}); "
                f"choose a tp that leaves each rank a multiple of {group} columns, or keep "
                f"{job.name!r} unquantized (quantization.ignore)"
            )

    def gemm(self, x: str, weight: str, out_features: int, out: str, name: str) -> str:
        """An unquantized linear reading tensor `weight` [out_features, K]."""
        rows = self.shape(x)[0]
        return self.node("Gemm", [x, weight], [self.act(out, (rows, out_features))], {"transB": 1}, name=name)[0]

    def rms_norm(self, x: str, module: str, out: str) -> str:
        """RMSNormalization over the last axis with the norm weight `module.weight` (job role 'norm')."""
        job = self.job(module, ((f"{module}.weight",),), "none", "norm")
        return self.node(
            "RMSNormalization",
            [x, job.weight_name],
            [self.act(out, self.shape(x))],
            {"axis": -1, "epsilon": self.spec.rms_norm_eps},
            name=module,
        )[0]

    def partial(self, out: str) -> str:
        """The name of the value a row-parallel linear writes before it is all-reduced into `out`
        (`out` itself at tp=1, where nothing is reduced)."""
        return out if self.tp == 1 else f"{out}.partial"

    def all_reduce(self, partial: str, out: str) -> str:
        """AllReduce of a rank's partial sum `partial` into `out`: the sum over the ranks (tp > 1);
        at tp=1 `partial` is already `out` and no node is added."""
        if self.tp == 1:
            return partial
        return self.node("AllReduce", [partial], [self.act(out, self.shape(partial))], name=f"{out}.all_reduce")[0]

    def all_gather(self, local: str, out: str) -> str:
        """AllGather of every rank's `local` [B, n] into `out` [B, tp * n], rank 0's columns first."""
        rows, cols = self.shape(local)
        return self.node(
            "AllGather", [local], [self.act(out, (rows, self.tp * cols))], {"axis": 1}, name=f"{out}.all_gather"
        )[0]

    def binary(self, op_type: str, a: str, b: str, out: str) -> str:
        """Add / Mul of two values; the result has the first one's shape."""
        return self.node(op_type, [a, b], [self.act(out, self.shape(a))])[0]

    # --- result ------------------------------------------------------------------------------------
    def finish(self, outputs: Sequence[str], metadata: Mapping[str, str]) -> Graph:
        graph = Graph(
            spec=self.spec,
            nodes=tuple(self.nodes),
            inputs=tuple(self.inputs),
            outputs=tuple(outputs),
            types=self.types,
            weights=self.weights,
            constants=self.constants,
            metadata=metadata,
            tp=self.tp,
        )
        check_graph(graph)
        return graph
