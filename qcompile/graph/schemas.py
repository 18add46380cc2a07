"""The `qcompile` ops as ONNX OpSchemas, so `onnx.checker` (check_custom_domain=True) can check them.

Registering is a change to onnx's process-wide schema registry, so it is never done on import: call
`register_op_schemas()` where such checking is wanted (tests, `qcompile verify`).
"""

from __future__ import annotations

from types import MappingProxyType

import onnx.defs
from onnx.defs import OpSchema

from qcompile.graph.ops import DOMAIN, DOMAIN_VERSION, FIXED_TYPES, SIGNATURES, TYPE_PARAMS, OpSignature

_ATTR_TYPES = MappingProxyType(
    {
        int: OpSchema.AttrType.INT,
        float: OpSchema.AttrType.FLOAT,
        str: OpSchema.AttrType.STRING,
        tuple: OpSchema.AttrType.INTS,
    }
)


def op_schema(op_type: str, sig: OpSignature) -> OpSchema:
    """The OpSchema of one `qcompile` op (no shape inference: the graph carries value types)."""
    used = sorted({code for _, code in (*sig.inputs, *sig.outputs) if code in TYPE_PARAMS})

    def param(name: str, code: str) -> OpSchema.FormalParameter:
        option = (
            OpSchema.FormalParameterOption.Optional if name.endswith("?") else OpSchema.FormalParameterOption.Single
        )
        type_str = code if code in TYPE_PARAMS else f"tensor({FIXED_TYPES[code]})"
        return OpSchema.FormalParameter(name.rstrip("?"), type_str, param_option=option)

    return OpSchema(
        op_type,
        DOMAIN,
        DOMAIN_VERSION,
        f"qcompile {op_type} (docs/OPS.md)",
        inputs=[param(name, code) for name, code in sig.inputs],
        outputs=[param(name, code) for name, code in sig.outputs],
        type_constraints=[(code, [f"tensor({t})" for t in TYPE_PARAMS[code]], "") for code in used],
        attributes=[
            OpSchema.Attribute(key, _ATTR_TYPES[kind], required=key not in sig.optional_attrs)
            for key, kind in sig.attrs.items()
        ],
    )


def register_op_schemas() -> None:
    """Register every `qcompile` op with onnx (idempotent)."""
    for op_type, sig in SIGNATURES.items():
        if not onnx.defs.has(op_type, DOMAIN):
            onnx.defs.register_schema(op_schema(op_type, sig))


def deregister_op_schemas() -> None:
    """Undo `register_op_schemas`."""
    for op_type in SIGNATURES:
        if onnx.defs.has(op_type, DOMAIN):
            onnx.defs.deregister_schema(op_type, DOMAIN_VERSION, DOMAIN)
