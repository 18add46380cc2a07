"""The op registry: (domain, op type) from graph.onnx -> the implementation bound to each node.

These are the torch reference implementations (docs/OPS.md); they run on any device and are what
every fast kernel is tested against."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from qruntime.ops import attention, collective, moe, quant, standard, vision
from qruntime.ops.base import Op

DEFAULT_DOMAIN = ""
QCOMPILE_DOMAIN = "qcompile"


def reference_ops() -> Mapping[tuple[str, str], type[Op]]:
    """(domain, op_type) -> Op class, for every op the compiler emits."""
    standard_ops = [standard.Gather, standard.RMSNormalization, standard.Add, standard.Mul, standard.Sigmoid]
    standard_ops += [standard.Split, standard.Reshape, standard.Gemm]
    standard_ops += [standard.ScatterND]  # Qwen3-VL's text graph (docs/vision.md)
    standard_ops += [vision.LayerNormalization, vision.Gelu, vision.Concat]
    qcompile_ops = [quant.DynamicQuant, quant.PTPCLinear, quant.BlockFP8Linear, quant.W4A16Linear, quant.AddRMSNorm]
    qcompile_ops += [quant.AddRMSNormQuant, quant.SiluMul, quant.SiluMulQuant]
    qcompile_ops += [attention.RoPE, attention.KVCacheWrite, attention.PagedAttention, attention.QKNormRoPEKVWrite]
    qcompile_ops += [moe.MoERouting, moe.ExpertWeight, moe.MoE]
    qcompile_ops += [collective.AllReduce, collective.AllReduceAddRMSNorm, collective.AllReduceAddRMSNormQuant]
    qcompile_ops += [collective.AllGather]
    qcompile_ops += [vision.PositionGrid, vision.VisionAttention]
    table = {(DEFAULT_DOMAIN, op.__name__): op for op in standard_ops}
    table.update({(QCOMPILE_DOMAIN, op.__name__): op for op in qcompile_ops})
    return MappingProxyType(table)


def triton_ops() -> Mapping[tuple[str, str], type[Op]]:
    """The reference table with the GPU fast path's ops in place of their reference versions."""
    from qruntime.ops.triton_ops import FAST_COLLECTIVE_OPS, FAST_OPS

    table = dict(reference_ops())
    fast = (*FAST_OPS, *FAST_COLLECTIVE_OPS)
    table.update({(QCOMPILE_DOMAIN, op.__name__): op for op in fast})  # same names as the reference ops
    return MappingProxyType(table)
