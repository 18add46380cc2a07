"""ScatterND (ONNX, default domain) as Qwen3-VL's text graph uses it: image rows written over the
token embeddings (reduction "none") and DeepStack features added to a layer's output ("add")."""

from __future__ import annotations

import pytest
import torch
from qruntime.ops.base import OpBindError
from qruntime.ops.registry import reference_ops, triton_ops
from qruntime.ops.standard import ScatterND


def _inputs(rng, dtype: torch.dtype, t: int, h: int, nv: int):
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    data = (torch.randn(t, h, generator=gen) * 4).to(dtype)
    rows = torch.randperm(t, generator=gen)[:nv].sort().values  # ascending, as the contract's vision_rows
    updates = (torch.randn(nv, h, generator=gen) * 4).to(dtype)
    return data, rows[:, None], updates


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("reduction", ["none", "add"])
def test_scatter_nd_replaces_or_adds_rows(rng, dtype, reduction):
    t, h, nv = 11, 24, 5
    data, indices, updates = _inputs(rng, dtype, t, h, nv)
    before = data.clone()
    attrs = {} if reduction == "none" else {"reduction": reduction}  # "none" is the default
    out = ScatterND(attrs, None)(None, data, indices, updates)
    assert torch.equal(data, before), "data must not be modified"
    expected = before.clone()
    for i, row in enumerate(indices[:, 0].tolist()):  # ONNX's loop, row by row
        expected[row] = updates[i] if reduction == "none" else expected[row] + updates[i]
    assert out.dtype == dtype and torch.equal(out, expected)
    others = torch.ones(t, dtype=torch.bool)
    others[indices[:, 0]] = False
    assert torch.equal(out[others], data[others])


@pytest.mark.parametrize("reduction", ["none", "add"])
def test_scatter_nd_without_rows_is_its_input(rng, reduction):
    data, indices, updates = _inputs(rng, torch.bfloat16, 7, 16, 0)
    assert indices.shape == (0, 1) and updates.shape == (0, 16)
    assert ScatterND({"reduction": reduction}, None)(None, data, indices, updates) is data


def test_scatter_nd_is_in_both_tables_and_capturable():
    for table in (reference_ops(), triton_ops()):
        assert table["", "ScatterND"] is ScatterND
    assert ScatterND.capturable


def test_scatter_nd_refuses_other_reductions_and_shapes(rng):
    for reduction in ("mul", "max", "min"):
        with pytest.raises(OpBindError, match=f"ScatterND reduction '{reduction}'"):
            ScatterND({"reduction": reduction}, None)
    op = ScatterND({}, None)
    data, indices, updates = _inputs(rng, torch.float32, 6, 8, 2)
    for bad in ((data, indices[:, 0], updates), (data, indices, updates[:, :-1]), (data, indices, updates[:1])):
        with pytest.raises(ValueError, match="ScatterND: indices must be"):
            op(None, *bad)
    with pytest.raises(ValueError, match="ScatterND: updates are torch.bfloat16"):
        op(None, data, indices, updates.bfloat16())
