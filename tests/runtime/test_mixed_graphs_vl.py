"""A Qwen3-VL plan's prefill and mixed steps on the whole-step and piecewise graphs (CPU: the capture
injected, attention the fast path's op under Triton's interpreter, as tests/runtime/test_mixed_graphs.py
runs Qwen3's): positions [3, T] padded to the bucket and image inputs empty give the eager plan's
logits and KV cache, for chunks with M-RoPE positions of their own (text after an image) and without;
a step holding image rows runs eagerly."""

from __future__ import annotations

import random

import pytest
import torch
from qruntime.engine.graph_capture import eager_capture
from qruntime.engine.mixed_graphs import MixedGraphs
from qruntime.engine.model_runner import ModelRunner
from qruntime.engine.piecewise_graphs import PiecewiseGraphs
from qruntime.engine.step_chunk import StepChunk
from qwen3_vl_checkpoints import IMAGE, TEXT, write_checkpoint
from test_mixed_graphs import Counted, _fast_attention_plan
from test_piecewise_graphs import BLOCKS, MAX_CONTEXT, _block_diff, _caches

from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import load_recipe

MAX_SEQS = 4
WIDTH = 3 * TEXT["hidden_size"]  # the embedding and two DeepStack features


@pytest.fixture(scope="module")
def vl_plan(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("vl-ckpt")
    write_checkpoint(ckpt, "dense")
    out = tmp_path_factory.mktemp("vl-art") / "artifact"
    compile_checkpoint(prepare(ckpt, load_recipe("bf16"), tokenizer=False), out, workers=1, progress=False)
    return _fast_attention_plan(out)


def _steps(rng: random.Random, block_size: int, vision: bool) -> list[list[StepChunk]]:
    """Three sequences on disjoint blocks, chunked over three steps; sequence 1's chunks carry M-RoPE
    rows of their own (each axis offset apart, as text after an image sits); with `vision`, one step
    gives sequence 2 image rows."""
    tokens = [[rng.randrange(IMAGE) for _ in range(30)] for _ in range(3)]
    per = -(-30 // block_size)
    tables = [tuple(range(s * per, (s + 1) * per)) for s in range(3)]
    done, steps = [0, 0, 0], []
    for sizes in ((5, 9, 3), (1, 7, 6), (rng.randint(1, 6), 1, rng.randint(1, 6))):
        step = []
        for s, n in enumerate(sizes):
            ids = tuple(tokens[s][done[s] : done[s] + n])
            mrope = None
            if s == 1:
                base = torch.arange(done[s], done[s] + n)
                mrope = tuple(tuple((base + shift).tolist()) for shift in (3, 7, 11))
            rows, embeds = (), None
            if vision and s == 2 and len(steps) == 1:
                rows = tuple(sorted(rng.sample(range(n), 3)))
                embeds = torch.randn(3, WIDTH)
            step.append(StepChunk(ids, done[s], tables[s], mrope, rows, embeds))
            done[s] += n
        steps.append(step)
    return steps


@pytest.mark.parametrize("graphs", ["mixed", "piecewise"])
def test_vl_steps_on_graphs_equal_the_eager_plan(vl_plan, graphs, rng):
    plan, spec, _ = vl_plan
    eager_cache, graph_cache = _caches(spec, rng)
    vision = (WIDTH, torch.float32)
    if graphs == "mixed":
        made = MixedGraphs(plan, graph_cache, (8, 24), BLOCKS, MAX_CONTEXT, MAX_SEQS, eager_capture, True, vision)
        runner = ModelRunner(
            plan, graph_cache, torch.device("cpu"), MAX_CONTEXT, mixed_graphs=made, mrope=True, vision=vision
        )
        counted = Counted(made)
    else:
        made = PiecewiseGraphs(plan, graph_cache, (8, 24), BLOCKS, MAX_CONTEXT, eager_capture, True, vision)
        runner = ModelRunner(
            plan, graph_cache, torch.device("cpu"), MAX_CONTEXT, piecewise_graphs=made, mrope=True, vision=vision
        )
        replays, run = [], made.run
        made.run = lambda *args: (replays.append(1), run(*args))[1]
    eager = ModelRunner(plan, eager_cache, torch.device("cpu"), MAX_CONTEXT, mrope=True, vision=vision)
    steps = _steps(rng, spec.block_size, vision=True)
    for chunks in steps:
        want, got = eager.execute(chunks), runner.execute(chunks)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert _block_diff(eager.kv_cache, runner.kv_cache) <= {BLOCKS}
    replayed = counted.steps if graphs == "mixed" else len(replays)
    assert replayed == len(steps) - 1  # the step with image rows ran eagerly
