"""GraphPass: a named, pure Graph -> Graph rewrite and the passes it needs to have run before it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from qcompile.graph.ir import Graph


@dataclass(frozen=True)
class GraphPass:
    """A registered pass. `requires` names passes that must be applied earlier in the same graph."""

    name: str
    run: Callable[[Graph], Graph]
    requires: tuple[str, ...] = ()

    def __call__(self, graph: Graph) -> Graph:
        return self.run(graph)

    @property
    def summary(self) -> str:
        """First line of the pass function's docstring."""
        return (self.run.__doc__ or "").strip().splitlines()[0]
