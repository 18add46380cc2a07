"""Helpers shared by the passes that fuse the weights of several linears into one tensor."""

from __future__ import annotations

from collections.abc import Sequence

from qcompile.compile.jobs import WeightJob
from qcompile.errors import PlanError
from qcompile.graph.ir import Node, TensorType
from qcompile.graph.ops import LINEAR_OPS
from qcompile.graph.rewrite import Rewrite
from qcompile.quant import QuantScheme, get_scheme
from qcompile.source.model import expected_tensors


def linear_weight(node: Node) -> str | None:
    """The weight tensor a linear node reads, or None when `node` is not a linear."""
    slot = LINEAR_OPS.get(node.op_type)
    return node.inputs[slot] if slot is not None and node.is_op(node.op_type) else None


def linear_reading(rw: Rewrite, job: WeightJob) -> int:
    """Index of the one linear node that reads `job`'s weight."""
    readers = [i for i in rw.users(job.weight_name) if linear_weight(rw.node(i)) == job.weight_name]
    if len(readers) != 1:
        raise ValueError(f"weight {job.weight_name!r} is read by {len(readers)} linear nodes, expected 1")
    return readers[0]


def check_fusable(
    pass_name: str, layer: int, jobs: Sequence[WeightJob], aligned: Sequence[str], rw: Rewrite
) -> QuantScheme:
    """The common scheme of `jobs`; PlanError when they differ or when a part in `aligned` (source tensors
    concatenated row-wise) is not a whole number of the scheme's weight-scale row blocks."""
    by_scheme: dict[str, list[str]] = {}
    for job in jobs:
        by_scheme.setdefault(job.scheme, []).append(job.name)
    if len(by_scheme) > 1:
        found = "; ".join(
            f"{scheme}: {', '.join(names[:3])}{' …' if len(names) > 3 else ''}" for scheme, names in by_scheme.items()
        )
        raise PlanError(
            f"pass {pass_name!r}: layer {layer}: cannot fuse linears with different quantization schemes "
            f"({found}). Remove {pass_name!r} from the recipe's passes, or change quantization.ignore so "
            "these modules are all quantized or all ignored."
        )
    scheme = get_scheme(jobs[0].scheme)
    align = scheme.row_align
    if align > 1:
        shapes = expected_tensors(rw.graph.spec)
        for source in aligned:
            rows = shapes[source][0]
            if rows % align:
                raise PlanError(
                    f"pass {pass_name!r}: layer {layer}: {source} has {rows} rows, not a multiple of the "
                    f"{align}-row weight blocks of scheme {scheme.name!r}, so a scale block would straddle "
                    f"two fused parts. Remove {pass_name!r} from the recipe's passes, or add "
                    f"{source.removesuffix('.weight')!r} and the modules fused with it to quantization.ignore, "
                    "or use a per-channel scheme such as ptpc-fp8."
                )
    return scheme


def fuse_linears(rw: Rewrite, pass_name: str, layer: int, modules: Sequence[str], fused: str, value: str) -> bool:
    """Replace the linears over jobs `modules` (reading one input) by one linear over job `fused` (their
    rows concatenated in order) and a Split back into the original outputs. False when a job is absent."""
    jobs = [rw.graph.weights.get(module) for module in modules]
    if any(job is None for job in jobs):
        return False
    parts: list[WeightJob] = [job for job in jobs if job is not None]
    scheme = check_fusable(pass_name, layer, parts, [s for job in parts for s in job.source_names()], rw)
    indices = [linear_reading(rw, job) for job in parts]
    nodes = [rw.node(i) for i in indices]
    slot = LINEAR_OPS[nodes[0].op_type]
    activation = nodes[0].inputs[:slot]
    if any(node.inputs[:slot] != activation for node in nodes):
        raise PlanError(f"pass {pass_name!r}: layer {layer}: {', '.join(modules)} do not read the same input")
    job = WeightJob(fused, (tuple(s for part in parts for s in part.source_names()),), False, scheme.name, "linear")
    outs = [rw.type_of(node.outputs[0]) for node in nodes]
    sizes = [int(t.shape[-1]) for t in outs]
    weight_inputs = job.quant_names
    at = min(indices)
    rw.remove(indices)
    rw.insert(
        at,
        Node(nodes[0].op_type, nodes[0].domain, (*activation, *weight_inputs), (value,), nodes[0].attrs, fused),
        {value: TensorType(outs[0].dtype, (outs[0].shape[0], sum(sizes)))},
    )
    split_outputs = tuple(node.outputs[0] for node in nodes)
    rw.insert(at, Node("Split", "", (value, rw.add_constant(sizes)), split_outputs, {"axis": -1}, f"{fused}.split"))
    rw.replace_jobs(list(modules), job)
    return True
