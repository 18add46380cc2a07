"""Fixtures of the graph-stage tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from qcompile.graph.schemas import deregister_op_schemas, register_op_schemas


@pytest.fixture(scope="session")
def op_schemas() -> Iterator[None]:
    """The qcompile op schemas registered with onnx, so the checker checks our custom nodes too."""
    register_op_schemas()
    yield
    deregister_op_schemas()
