"""CUDA graphs captured at first use (load's default graph_capture="first-use") on the GPU: a load
captures none, the first steps capture what they need in the middle of serving (async scheduling,
sequences decoding beside new prompts, blocks reused), and the greedy tokens are those of an engine
that captured every graph at load, bit for bit (the same kernels on the same shapes). idle_work then
captures the rest and runs the warm-up steps, after which nothing is pending and the outputs are
the same again."""

from __future__ import annotations

import pytest
import qruntime
import torch
from qruntime import SamplingParams

pytestmark = pytest.mark.gpu

SIZES = {"num_kv_blocks": 256, "max_num_seqs": 16, "max_num_batched_tokens": 512, "prefix_cache": False}


def _pending(engine) -> dict[str, tuple[int, ...]]:
    runner = engine.runner
    graphs = {"decode": runner.decode_graphs, "mixed": runner.mixed_graphs, "piecewise": runner.piecewise_graphs}
    return {kind: g.pending for kind, g in graphs.items() if g is not None}


def _serve(engine, prompts, rng_lengths) -> list[tuple[int, ...]]:
    """Requests arriving in two waves: the second beside the first's decodes (mixed steps)."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in rng_lengths]
    half = len(prompts) // 2
    ids = [engine.add_request(p, s) for p, s in zip(prompts[:half], params[:half], strict=True)]
    out = {}
    for _ in range(3):
        out.update((d.request_id, d.output) for d in engine.step() if d.finished)
    ids += [engine.add_request(p, s) for p, s in zip(prompts[half:], params[half:], strict=True)]
    while engine.has_unfinished():
        out.update((d.request_id, d.output) for d in engine.step() if d.finished)
    return [tuple(out[i].token_ids) for i in ids]


def test_graphs_captured_at_first_use_give_the_tokens_of_graphs_captured_at_load(gpu_artifact, cuda, rng):
    prompts = [[rng.randrange(10, 250) for _ in range(rng.randint(3, 300))] for _ in range(10)]
    lengths = [rng.randint(4, 40) for _ in prompts]
    with qruntime.load(gpu_artifact, device=cuda, graph_capture="load", **SIZES) as eager:
        assert eager.description["graph_capture"] == "load"
        assert not any(_pending(eager).values()) and not eager.runner.has_idle_work()
        want = _serve(eager, prompts, lengths)
    with qruntime.load(gpu_artifact, device=cuda, **SIZES) as lazy:
        assert lazy.description["graph_capture"] == "first-use"
        pending = _pending(lazy)
        assert set(pending) == {"decode", "mixed", "piecewise"}
        assert pending["decode"] == lazy.runner.decode_graphs.buckets  # nothing captured at load
        assert pending["mixed"] == lazy.runner.mixed_graphs.buckets
        got = _serve(lazy, prompts, lengths)
        assert got == want
        captured = {
            kind: len(getattr(lazy.runner, f"{kind}_graphs").buckets) - len(p) for kind, p in _pending(lazy).items()
        }
        print("captured at first use:", captured, "pending:", _pending(lazy))
        assert captured["decode"] >= 2 and captured["mixed"] >= 1
        rounds = 0
        while lazy.idle_work():
            rounds += 1
        torch.cuda.synchronize()
        assert not any(_pending(lazy).values()) and lazy.runner.warm_up is None
        assert rounds == sum(map(len, pending.values())) - sum(captured.values())
        assert _serve(lazy, prompts, lengths) == want
