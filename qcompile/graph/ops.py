"""The operator contract of docs/OPS.md as data: the op types a graph may use, their domains, and the
signature (inputs, outputs, attributes, element types) of every `qcompile` op."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

OPSET = 23  # ONNX default domain
DOMAIN = "qcompile"
DOMAIN_VERSION = 1

STANDARD_OPS = frozenset({"Gather", "RMSNormalization", "Add", "Mul", "Sigmoid", "Split", "Reshape", "Gemm"})
# Qwen3-VL (docs/vision.md, "Artifacts"): the image rows merged into the text graph, and the vision graph's
VISION_STANDARD_OPS = frozenset({"ScatterND", "LayerNormalization", "Gelu", "Concat"})

# element types of op parameters: T = the model dtype, W = a weight (model dtype, fp8, or packed int4 in int32)
TYPE_PARAMS = MappingProxyType(
    {"T": ("bfloat16", "float16", "float"), "W": ("bfloat16", "float16", "float", "float8e4m3fn", "int32")}
)
FIXED_TYPES = MappingProxyType({"F8": "float8e4m3fn", "F32": "float", "I64": "int64", "I32": "int32", "U8": "uint8"})


@dataclass(frozen=True)
class OpSignature:
    """Inputs and outputs as (name, element type code); a name ending in '?' is an optional input.
    `attrs` maps attribute name -> Python type; `optional_attrs` may be left out."""

    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    attrs: Mapping[str, type] = field(default_factory=dict)
    optional_attrs: frozenset[str] = frozenset()

    min_inputs: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "attrs", MappingProxyType(dict(self.attrs)))
        object.__setattr__(self, "min_inputs", sum(not name.endswith("?") for name, _ in self.inputs))


_KV = MappingProxyType(
    {"layer": int, "layout": str, "block_size": int, "kv_dtype": str, "k_scale": float, "v_scale": float}
)
_QUANT_OUT = (("yq", "F8"), ("ys", "F32"))

# group_size (DynamicQuant and the ops fused with it): 0 = one activation scale per token, n > 0 = per
# n channels of a token, -1 = one scale for the whole step (per-tensor; xs [T, 1], the value repeated)
SIGNATURES: Mapping[str, OpSignature] = MappingProxyType(
    {
        # simple ops
        "DynamicQuant": OpSignature((("x", "T"),), (("xq", "F8"), ("xs", "F32")), {"group_size": int}),
        "PTPCLinear": OpSignature((("xq", "F8"), ("xs", "F32"), ("w", "F8"), ("ws", "T")), (("y", "T"),)),
        "BlockFP8Linear": OpSignature(
            (("xq", "F8"), ("xs", "F32"), ("w", "F8"), ("ws", "T")), (("y", "T"),), {"block_n": int, "block_k": int}
        ),
        # int4 weights packed 8 to an int32 along K, one scale per row and group_size columns (w4a16), and
        # with zero points one 4-bit code per scale (w4a16-zp)
        "W4A16Linear": OpSignature(
            (("x", "T"), ("w", "I32"), ("ws", "T"), ("wz?", "U8")), (("y", "T"),), {"group_size": int}
        ),
        # mrope_section (Qwen3-VL): [s_t, s_h, s_w] interleaved M-RoPE, positions [3, T] (docs/vision.md)
        "RoPE": OpSignature(
            (("x", "T"), ("positions", "I64")),
            (("y", "T"),),
            {"theta": float, "head_dim": int, "mrope_section": tuple},
            optional_attrs=frozenset({"mrope_section"}),
        ),
        "KVCacheWrite": OpSignature((("k", "T"), ("v", "T"), ("slot_mapping", "I64")), (("kv_ready", "U8"),), _KV),
        "PagedAttention": OpSignature(
            (
                ("q", "T"),
                ("kv_ready", "U8"),
                ("block_tables", "I32"),
                ("context_lens", "I32"),
                ("query_start_loc", "I32"),
            ),
            (("o", "T"),),
            {**_KV, "num_heads": int, "num_kv_heads": int, "head_dim": int, "scale": float},
        ),
        "MoERouting": OpSignature(
            (("router_logits", "T"),),
            (("topk_weights", "T"), ("topk_ids", "I64")),
            {"top_k": int, "norm_topk_prob": int},
        ),
        "ExpertWeight": OpSignature((("topk_weights", "T"), ("topk_ids", "I64")), (("coef", "T"),), {"expert": int}),
        "AllReduce": OpSignature((("x", "T"),), (("y", "T"),)),
        "AllGather": OpSignature((("x", "T"),), (("y", "T"),), {"axis": int}),
        # fused ops
        "AddRMSNorm": OpSignature(
            (("x", "T"), ("residual?", "T"), ("w", "T")), (("y", "T"), ("residual_out", "T")), {"epsilon": float}
        ),
        "AddRMSNormQuant": OpSignature(
            (("x", "T"), ("residual?", "T"), ("w", "T")),
            (*_QUANT_OUT, ("residual_out", "T")),
            {"epsilon": float, "group_size": int},
        ),
        "AllReduceAddRMSNorm": OpSignature(
            (("x", "T"), ("residual?", "T"), ("w", "T")), (("y", "T"), ("residual_out", "T")), {"epsilon": float}
        ),
        "AllReduceAddRMSNormQuant": OpSignature(
            (("x", "T"), ("residual?", "T"), ("w", "T")),
            (*_QUANT_OUT, ("residual_out", "T")),
            {"epsilon": float, "group_size": int},
        ),
        "SiluMul": OpSignature((("gate_up", "T"),), (("y", "T"),)),
        "SiluMulQuant": OpSignature((("gate_up", "T"),), _QUANT_OUT, {"group_size": int}),
        "QKNormRoPEKVWrite": OpSignature(
            (("qkv", "T"), ("q_norm_w", "T"), ("k_norm_w", "T"), ("positions", "I64"), ("slot_mapping", "I64")),
            (("q", "T"), ("kv_ready", "U8")),
            {
                **_KV,
                "num_heads": int,
                "num_kv_heads": int,
                "head_dim": int,
                "epsilon": float,
                "theta": float,
                "mrope_section": tuple,
            },
            optional_attrs=frozenset({"mrope_section"}),
        ),
        # the Qwen3-VL vision graph (docs/vision.md, "Artifacts")
        "PositionGrid": OpSignature((("table", "T"), ("index", "I64"), ("weight", "F32")), (("y", "T"),)),
        "VisionAttention": OpSignature(
            (("qkv", "T"), ("cos", "F32"), ("sin", "F32"), ("cu_seqlens", "I32")),
            (("o", "T"),),
            {"num_heads": int, "head_dim": int, "scale": float},
        ),
        "MoE": OpSignature(
            (
                ("x", "T"),
                ("router_w", "T"),
                ("w13", "W"),
                ("w13_scale?", "T"),
                ("w2", "W"),
                ("w2_scale?", "T"),
                ("w13_zero_point?", "U8"),
                ("w2_zero_point?", "U8"),
            ),
            (("y", "T"),),
            {
                "num_experts": int,
                "top_k": int,
                "norm_topk_prob": int,
                "linear": str,
                "group_size": int,
                "block_n": int,
                "block_k": int,
            },
            optional_attrs=frozenset({"block_n", "block_k"}),
        ),
    }
)
FUSED_OPS = frozenset(
    {
        "AddRMSNorm",
        "AddRMSNormQuant",
        "AllReduceAddRMSNorm",
        "AllReduceAddRMSNormQuant",
        "SiluMul",
        "SiluMulQuant",
        "QKNormRoPEKVWrite",
        "MoE",
    }
)
SIMPLE_OPS = frozenset(SIGNATURES) - FUSED_OPS
# the ops that combine the tensor-parallel ranks' outputs (only in the graphs of a tp > 1 artifact): the
# sums of partial outputs, and the gather of the vocabulary-parallel lm_head's logits
COLLECTIVE_OPS = frozenset({"AllReduce", "AllReduceAddRMSNorm", "AllReduceAddRMSNormQuant", "AllGather"})

# op type -> domain ('' is the ONNX default domain)
OP_DOMAINS = MappingProxyType(
    {**{op: "" for op in STANDARD_OPS | VISION_STANDARD_OPS}, **{op: DOMAIN for op in SIGNATURES}}
)

# the linear op of each weight layout, and where its weight sits among its inputs
LINEAR_OPS = MappingProxyType({"Gemm": 1, "PTPCLinear": 2, "BlockFP8Linear": 2, "W4A16Linear": 1})


def check_signature(
    op_type: str, inputs: tuple[str, ...], outputs: tuple[str, ...], attrs: Mapping[str, object]
) -> str | None:
    """What is wrong with a `qcompile` node against its signature, or None when it conforms."""
    sig = SIGNATURES[op_type]
    if not sig.min_inputs <= len(inputs) <= len(sig.inputs):
        return f"takes {sig.min_inputs}..{len(sig.inputs)} inputs, got {len(inputs)}"
    for (name, _), value in zip(sig.inputs, inputs, strict=False):
        if not value and not name.endswith("?"):
            return f"input {name!r} is required"
    if len(outputs) != len(sig.outputs):
        return f"has {len(sig.outputs)} outputs, got {len(outputs)}"
    unknown = sorted(set(attrs) - set(sig.attrs))
    missing = sorted(set(sig.attrs) - set(attrs) - sig.optional_attrs)
    if unknown or missing:
        return f"attributes: unknown {unknown}, missing {missing}"
    for key, value in attrs.items():
        kind = sig.attrs[key]
        if kind is tuple and not (isinstance(value, tuple) and all(type(v) is int for v in value)):
            return f"attribute {key!r} must be a tuple of ints, got {value!r}"
        if isinstance(value, bool) or not isinstance(value, kind):
            return f"attribute {key!r} must be {kind.__name__}, got {value!r}"
    return None
