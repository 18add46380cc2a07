"""The ONNX default-domain ops the compiler emits (docs/OPS.md), on torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qruntime.ops import functional as fn
from qruntime.ops.base import Op, OpBindError


class Gather(Op):
    """Embedding lookup / row selection along axis 0."""

    attrs = ("axis",)

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        if self.a["axis"] != 0:
            raise OpBindError(f"Gather axis {self.a['axis']} (only axis 0 is used by the compiler)")

    def __call__(self, step, data, indices):
        return data.index_select(0, indices.long())


class RMSNormalization(Op):
    attrs = ("epsilon",)
    optional_attrs = {"axis": -1}

    def __call__(self, step, x, w):
        return fn.rms_norm(x, w, self.a["epsilon"])


class Add(Op):
    def __call__(self, step, x, y):
        return x + y


class Mul(Op):
    def __call__(self, step, x, y):
        return x * y


class Sigmoid(Op):
    def __call__(self, step, x):
        return torch.sigmoid(x)


class Split(Op):
    """Split along `axis` by the sizes in the (constant) second input."""

    attrs = ("axis",)

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        if len(consts) < 2 or consts[1] is None:
            raise OpBindError("Split needs its sizes as a graph initializer")
        self.sizes = [int(v) for v in consts[1].tolist()]

    def __call__(self, step, x, sizes):
        return tuple(torch.split(x, self.sizes, dim=self.a["axis"]))


class Reshape(Op):
    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        if len(consts) < 2 or consts[1] is None:
            raise OpBindError("Reshape needs its shape as a graph initializer")
        self.shape = [int(v) for v in consts[1].tolist()]

    def __call__(self, step, x, shape):
        return x.reshape(self.shape)


class Gemm(Op):
    """y = A Bᵀ in the compute dtype (an unquantized linear: lm_head, router, ignored layers)."""

    optional_attrs = {"transB": 0, "transA": 0, "alpha": 1.0, "beta": 1.0}

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        if (self.a["transA"], self.a["transB"], self.a["alpha"]) != (0, 1, 1.0):
            raise OpBindError("Gemm is implemented for transA=0, transB=1, alpha=1 (what the compiler emits)")

    def __call__(self, step, x, w, bias=None):
        return F.linear(x, w, bias)


class ScatterND(Op):
    """Rows of `data` [T, H] replaced by (reduction "none") or added to ("add") `updates` [Nv, H] at
    `indices` [Nv, 1] (ONNX ScatterND on axis 0): Qwen3-VL's image embeddings and DeepStack features
    (docs/vision.md). Returns a new tensor, `data` untouched; with Nv = 0 returns `data` itself (no
    copy, no launch). The rows are the caller's to keep in range (no device sync checks them)."""

    optional_attrs = {"reduction": "none"}

    def __init__(self, attrs, env, consts=()) -> None:
        super().__init__(attrs, env, consts)
        if self.a["reduction"] not in ("none", "add"):
            raise OpBindError(f"ScatterND reduction {self.a['reduction']!r} (only 'none' and 'add' are implemented)")
        self.accumulate = self.a["reduction"] == "add"

    def __call__(self, step, data, indices, updates):
        nv = indices.shape[0]
        if indices.ndim != 2 or indices.shape[1] != 1 or tuple(updates.shape) != (nv, *data.shape[1:]):
            raise ValueError(
                f"ScatterND: indices must be [Nv, 1] and updates [Nv, {list(data.shape[1:])}] for data "
                f"{list(data.shape)}, got indices {list(indices.shape)}, updates {list(updates.shape)}"
            )
        if updates.dtype != data.dtype:
            raise ValueError(f"ScatterND: updates are {updates.dtype}, data {data.dtype}")
        if nv == 0:
            return data
        return data.index_put((indices[:, 0],), updates, accumulate=self.accumulate)
