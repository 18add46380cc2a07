"""Tensor-parallel engines (`qruntime.load` of a `--tp 2` artifact) on CPU: 2 processes over gloo.

The tp=2 engine against the tp=1 engine of the same checkpoint, step by step (rank 0's logits of
every step, recorded as the engine runs): bf16 weights agree to fp32 summation order and generate
the same greedy tokens, dense and MoE, with batched prompts of different lengths, chunked prefill
included; ptpc-fp8 agrees within FP8 rounding (each rank quantizes its shard of a row-parallel
layer's input with its own per-token scale). Then the process lifecycle: close leaves no child and
no process group; a wrong tp, a worker that fails at load, raises mid-step or is killed are errors
naming the rank, never hangs, and leave nothing running.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import pickle
import random
import re
import shutil
import signal
import time

import onnx
import pytest
import qruntime
import torch
import torch.distributed as dist
from hf_reference import sqnr_db
from qruntime import SamplingParams, WorkerError
from qruntime.artifact import sha256_file
from qruntime.engine.request import Request
from qruntime.engine.scheduler import ScheduledChunk
from qruntime.engine.step_chunk import StepChunk
from qruntime.engine.worker_process import share_cores

CACHE = {"num_kv_blocks": 48, "max_model_len": 256}
FP32 = {"device": "cpu", "dtype": torch.float32, **CACHE}
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
PROMPT_LENGTHS = (5, 17, 40, 71)  # inside a block, past one, and longer than a prefill chunk
HANG = 30.0  # seconds: a failure reported later than this counts as a hang


def _prompts(rng: random.Random, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def _no_workers_left() -> bool:
    return not multiprocessing.active_children() and not dist.is_initialized()


def _generate_recording(engine, monkeypatch, prompts) -> tuple[list[tuple[int, ...]], list[torch.Tensor]]:
    """Greedy outputs, and the logits of every step (rank 0's) in order."""
    steps: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recording(chunks, all_logits=False, **kw):
        logits = execute(chunks, all_logits, **kw)
        steps.append(logits.float().clone())
        return logits

    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "execute", recording)
        outputs = engine.generate(prompts, GREEDY)
    return [o.token_ids for o in outputs], steps


def test_steps_are_plain_data(rng):
    """What rank 0 sends the workers: a scheduled chunk's tokens as plain data, through pickle unchanged."""
    for _ in range(200):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
        request = Request("r", prompt, 8, output_token_ids=[rng.randrange(1000) for _ in range(rng.randrange(8))])
        start = rng.randrange(request.num_tokens)
        count = rng.randrange(1, request.num_tokens - start + 1)
        table = tuple(rng.sample(range(100), -(-(start + count) // 16)))
        chunk = StepChunk.of(ScheduledChunk(request, start, count, table, start + count == request.num_tokens))
        assert chunk == StepChunk(tuple(request.all_token_ids[start : start + count]), start, table)
        assert pickle.loads(pickle.dumps(chunk)) == chunk and chunk.num_tokens == count


def _relative_error(reference: torch.Tensor, other: torch.Tensor) -> float:
    return float((reference - other).abs().max() / reference.abs().max())


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_moe_ckpt"])
def test_bf16_tp2_equals_tp1_step_by_step(request, fixture, compiled, monkeypatch, rng):
    ckpt = request.getfixturevalue(fixture)
    # a 32-token budget: the longer prompts prefill in chunks, so steps mix prefill and decode
    tp1 = qruntime.load(compiled(ckpt, "bf16"), max_num_batched_tokens=32, **FP32)
    prompts = _prompts(rng, tp1.vocab_size)
    tokens, steps = _generate_recording(tp1, monkeypatch, prompts)
    threads = torch.get_num_threads()
    with qruntime.load(compiled(ckpt, "bf16", "tp=2"), max_num_batched_tokens=32, **FP32) as tp2:
        assert tp2.description["tp"] == 2 and len(multiprocessing.active_children()) == 1
        assert torch.get_num_threads() == share_cores(2)  # rank 0 takes a worker's share of the cores
        shard = tp2.runner.vocab_shard  # rank 0 holds the head's first half of the vocabulary
        assert shard is not None and "vocabulary shards" in tp2.description["sampling"]
        tp2_tokens, tp2_steps = _generate_recording(tp2, monkeypatch, prompts)  # chosen from the shards
        assert len(tp2_steps) == len(steps) > GREEDY.max_tokens  # prefill chunks, then 15 decode steps
        compared = len(steps)
        if tp2_tokens != tokens:  # only a near-tie may flip: fp32 sums in another order (seen: 6e-8 apart)
            p, i = next(
                (p, i)
                for p, (a, b) in enumerate(zip(tokens, tp2_tokens, strict=True))
                for i in range(len(a))
                if a[i] != b[i]
            )
            scores = tp1.score(prompts[p] + list(tokens[p][:i]))[-1]
            gap = float(scores[tokens[p][i]] - scores[tp2_tokens[p][i]])
            assert abs(gap) <= 1e-5 * float(scores.abs().max()), f"prompt {p} token {i}: not a near-tie ({gap})"
            # the steps before the flip had equal inputs: compare up to the first that no longer does
            compared = next(
                (
                    k
                    for k, (a, b) in enumerate(zip(steps, tp2_steps, strict=True))
                    if _relative_error(a[:, : b.shape[1]], b) >= 1e-5
                ),
                len(steps),  # the flip was at the last step
            )
            assert compared > 0
        for index, (logits, tp2_logits) in enumerate(zip(steps[:compared], tp2_steps[:compared], strict=True)):
            assert tp2_logits.shape[1] * 2 == logits.shape[1] == tp2.vocab_size
            assert _relative_error(logits[:, : tp2_logits.shape[1]], tp2_logits) < 1e-5, f"step {index}"
        # seeded sampling as tp=1's: temperature / top_k / min_p / logit_bias from the shards, and
        # top_p (which needs whole rows) from gathered logits
        seeds = [rng.randrange(1 << 30) for _ in prompts]
        for extra in ({"top_k": 20, "min_p": 0.02, "logit_bias": {7: 2.5, 300: -1.0}}, {"top_p": 0.95}):
            seeded = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True, **extra) for s in seeds]
            sampled = [o.token_ids for o in tp1.generate(prompts, seeded)]
            assert [o.token_ids for o in tp2.generate(prompts, seeded)] == sampled, extra
            assert len({tuple(t) for t in sampled}) > 1
        # the engine keeps serving: a scored sequence (one prefill over all its tokens, gathered) agrees too
        ids = prompts[2] + list(tokens[2])
        assert _relative_error(tp1.score(ids), tp2.score(ids)) < 1e-5
    assert _no_workers_left() and torch.get_num_threads() == threads  # the caller's count back
    with pytest.raises(RuntimeError, match="the engine is closed"):
        tp2.generate(prompts[0], GREEDY)


def test_ptpc_fp8_tp2_within_fp8_rounding_of_tp1(tiny_ckpt, compiled, monkeypatch, rng):
    """Row-parallel layers (o_proj, down_proj) quantize each rank's half of their input with its own
    per-token scale: the tp=2 model is another FP8 rounding of the same weights, not the same numbers.
    Steps are compared while both engines have generated the same tokens (then their inputs agree)."""
    tp1 = qruntime.load(compiled(tiny_ckpt, "ptpc-fp8"), **FP32)
    prompts = _prompts(rng, tp1.vocab_size)
    tokens, steps = _generate_recording(tp1, monkeypatch, prompts)
    with qruntime.load(compiled(tiny_ckpt, "ptpc-fp8", "tp=2"), **FP32) as tp2:
        tp2_tokens, tp2_steps = _generate_recording(tp2, monkeypatch, prompts)
        ids = prompts[3] + list(tokens[3])
        scored, tp2_scored = tp1.score(ids), tp2.score(ids)
    assert _no_workers_left()
    # step i (0: the prefill) samples token i: steps up to the first token that differs had equal inputs
    differ = [i for i in range(GREEDY.max_tokens) if any(a[i] != b[i] for a, b in zip(tokens, tp2_tokens, strict=True))]
    compared = len(steps) if not differ else differ[0] + 1
    for index, (logits, tp2_logits) in enumerate(zip(steps[:compared], tp2_steps[:compared], strict=True)):
        logits = logits[:, : tp2_logits.shape[1]]  # rank 0's shard of the vocabulary-parallel head
        assert sqnr_db(logits, tp2_logits) > 25, f"step {index}"
        assert not torch.allclose(logits, tp2_logits, atol=1e-5)  # another rounding indeed
    assert sqnr_db(scored, tp2_scored) > 25
    assert float((scored.argmax(-1) == tp2_scored.argmax(-1)).float().mean()) >= 0.8


@pytest.fixture(scope="module")
def tp2_art(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "bf16", "tp=2")


@pytest.fixture
def copy(tp2_art, tmp_path):
    """A private copy of the tp=2 artifact to break."""
    return shutil.copytree(tp2_art, tmp_path / "art")


def _replace_graph(root, rank: int, model: onnx.ModelProto | bytes) -> None:
    """Write rank `rank`'s graph and record its new size and sha256, as if the compiler had written it."""
    rel = f"graph.rank{rank}.onnx"
    (root / rel).write_bytes(model if isinstance(model, bytes) else model.SerializeToString())
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"][rel] = {"sha256": sha256_file(root / rel), "bytes": (root / rel).stat().st_size}
    (root / "manifest.json").write_text(json.dumps(manifest))


def test_tp_other_than_the_artifacts_names_both(tp2_art):
    with pytest.raises(ValueError, match=r"tp=1 was asked for but .* is sharded for tp=2: load it with tp=2"):
        qruntime.load(tp2_art, tp=1, **FP32)
    assert _no_workers_left()


def test_default_process_group_of_the_caller_is_refused(tp2_art, tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already has a torch.distributed default process group"):
            qruntime.load(tp2_art, **FP32)
        assert not multiprocessing.active_children()
        assert dist.is_initialized()  # the caller's group is left alone
    finally:
        dist.destroy_process_group()


def test_worker_failing_at_load_names_its_rank_and_leaves_nothing(copy, tp2_art):
    _replace_graph(copy, 1, b"not ONNX" + os.urandom(random.randint(16, 512)))
    start = time.monotonic()
    with pytest.raises(
        WorkerError, match=r"rank 1 failed: .*ArtifactFormatError: .*graph\.rank1\.onnx: cannot be read"
    ):
        qruntime.load(copy, **FP32)
    assert time.monotonic() - start < HANG
    assert _no_workers_left()
    with qruntime.load(tp2_art, **FP32) as engine:  # nothing left behind breaks the next load
        assert len(engine.generate([1, 2, 3], SamplingParams(max_tokens=2))[0].token_ids) == 2
    assert _no_workers_left()


def test_worker_raising_mid_step_sends_its_traceback(copy):
    """Rank 1's lm_head (replicated: the last op of a step) gets transposed dims of the same bytes:
    it loads and binds, and fails when it runs, on rank 1 only."""
    model = onnx.load(str(copy / "graph.rank1.onnx"), load_external_data=False)
    (head,) = [i for i in model.graph.initializer if i.name == "lm_head.weight"]
    head.dims[:] = list(reversed(head.dims))
    _replace_graph(copy, 1, model)
    engine = qruntime.load(copy, **FP32)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        engine.generate([[5, 6, 7], [8, 9]], GREEDY)
    assert time.monotonic() - start < HANG
    assert info.value.rank == 1
    assert re.search(r"rank 1 failed: RuntimeError: .*shapes cannot be multiplied", str(info.value))
    assert "Traceback (most recent call last)" in info.value.worker_traceback
    assert _no_workers_left()
    with pytest.raises(RuntimeError, match=r"the tensor-parallel engine is closed \(tensor-parallel rank 1 failed"):
        engine.generate([1, 2], GREEDY)


def test_killed_worker_is_an_error_not_a_hang(tp2_art):
    engine = qruntime.load(tp2_art, **FP32)
    (worker,) = multiprocessing.active_children()
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=rf"rank 1 failed: its process {worker.pid} died \(signal SIGKILL\)"):
        engine.generate([[4, 5, 6], [7, 8]], GREEDY)
    assert time.monotonic() - start < HANG
    assert _no_workers_left()


def test_killed_worker_with_a_step_in_flight_is_an_error(tp2_art, rng):
    """Async scheduling: rank 0 is not waiting in a step when the worker dies, but at its next read."""
    engine = qruntime.load(tp2_art, **FP32)
    assert engine.async_scheduling
    (worker,) = multiprocessing.active_children()
    engine.add_request(
        [rng.randrange(engine.vocab_size) for _ in range(7)], SamplingParams(max_tokens=8, ignore_eos=True)
    )
    engine.step()  # the prefill is launched and left in flight
    engine.step()  # the first decode launched, the prefill read
    assert engine._in_flight is not None
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=rf"rank 1 failed: its process {worker.pid} died \(signal SIGKILL\)"):
        while engine.has_unfinished():
            engine.step()
    assert time.monotonic() - start < HANG
    assert not multiprocessing.active_children() and not dist.is_initialized()


def test_finaliser_stops_the_workers_of_a_dropped_engine(tp2_art):
    engine = qruntime.load(tp2_art, **FP32)
    assert len(multiprocessing.active_children()) == 1
    del engine
    gc.collect()
    assert _no_workers_left()


def test_idle_work_reaches_every_rank_between_steps(tp2_art, rng):
    """Engine.idle_work at tp = 2 sends the workers their turn of it (they capture the same graphs
    at the same point: the graphs hold the all-reduces) and does rank 0's; the steps after it run
    as before. On CPU no rank has graphs, so rank 0's piece is a warm-up standing in."""
    prompts = _prompts(rng, 200)
    with qruntime.load(tp2_art, **FP32) as engine:
        before = [o.token_ids for o in engine.generate(prompts, GREEDY)]
        assert not engine.idle_work()  # nothing left by a CPU load: nothing sent
        warmed = []
        engine.runner.warm_up = lambda: warmed.append(engine.has_unfinished())
        engine.add_request(prompts[0], GREEDY)
        assert engine.idle_work() and warmed == []  # a request is unfinished: the work waits
        while engine.has_unfinished():
            engine.step()
        assert engine.idle_work() is False and warmed == [False]
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == before
    assert _no_workers_left()
