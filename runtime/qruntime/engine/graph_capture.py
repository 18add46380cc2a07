"""How a step's graphs are captured: a `Capture` turns a function that runs part of the plan on
static inputs into its outputs and a replay. cuda_capture makes CUDA graphs; eager_capture runs the
function again at each replay (CPU, tests), so the graph classes (cuda_graphs.py, piecewise_graphs.py,
mixed_graphs.py) run the same code with and without CUDA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Outputs = dict[str, torch.Tensor]
# capture(run_piece) -> (outputs, replay): run_piece runs the piece on its static inputs and returns
# its outputs; after replay() the returned outputs hold the piece's values for the inputs' contents.
Capture = Callable[[Callable[[], Outputs]], tuple[Outputs, Callable[[], None]]]


def cuda_capture(pool) -> Capture:
    """Capture each piece as a CUDA graph in `pool`, after two warm-up runs on a side stream (triton
    compiles, autotuned libraries pick), and replay it once so its outputs hold real values for the
    eager op after it (a router fed garbage could route to experts that do not exist).

    Captures may come in the middle of serving (graphs captured at first use: rank.py), while other
    threads of the process use CUDA: the capture refuses unsafe calls of its own thread only
    (capture_error_mode "thread_local"); work other threads queue on their streams is not captured."""

    def capture(run_piece: Callable[[], Outputs]) -> tuple[Outputs, Callable[[], None]]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                run_piece()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            outputs = run_piece()
        graph.replay()
        return outputs, graph.replay

    return capture


def eager_capture(run_piece: Callable[[], Outputs]) -> tuple[Outputs, Callable[[], None]]:
    """What a capture does, without CUDA (CPU, tests): 'replay' runs the piece again and copies its
    outputs into the first run's tensors, which the next pieces read, as a graph's replay would."""
    outputs = run_piece()

    def replay() -> None:
        for name, value in run_piece().items():
            outputs[name].copy_(value)

    return outputs, replay
