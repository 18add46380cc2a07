"""The tune tests' timer: tune_*'s `wall_us` over a real clock, recording how many calls each
timing ran (the tests check every candidate was timed, on both weight copies)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def wall_timer(device: torch.device, timed: list[int]) -> Callable[[list[Callable[[], object]]], float]:
    """wall_us(calls) -> microseconds per call of running `calls` in order (synchronized on CUDA),
    appending len(calls) to `timed`."""

    def wall_us(calls: list[Callable[[], object]]) -> float:
        start = time.perf_counter()
        for call in calls:
            call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        timed.append(len(calls))
        return (time.perf_counter() - start) * 1e6 / len(calls)

    return wall_us
