"""Async scheduling at tp > 1 (2 gloo processes on CPU): rank 0 launches step N+1 before it reads
step N's tokens, and the workers resolve N+1's pending ids from the tokens they sampled with rank 0
(sharded sampling) or that rank 0 sent them (rows it samples alone). Outputs must be exactly the
synchronous tp=2 engine's for a workload mixing greedy, stop tokens, seeded sampling from the
shards, top_p, penalties and logprobs (gathered rows), thinking caps (forced rows, put in on every
rank), aborts mid-flight and preemption."""

from __future__ import annotations

import multiprocessing
import pickle
import random

import pytest
import qruntime
import torch
import torch.distributed as dist
from qruntime import SamplingParams
from qruntime.engine import sampled_tokens, worker_process
from qruntime.engine.sampled_tokens import SampledTokens
from qruntime.engine.sampler import Forced
from qruntime.engine.sharded_sampler import Rule, ShardedSampling
from qruntime.engine.step_chunk import StepChunk, pending

FP32 = {"device": "cpu", "dtype": torch.float32, "max_model_len": 256, "prefix_cache": False}
HANG = 30.0


@pytest.fixture(scope="module")
def tp2(tiny_ckpt, compiled):
    # a tight pool and token budget: long prompts prefill in chunks and requests get preempted
    with qruntime.load(
        compiled(tiny_ckpt, "bf16", "tp=2"), num_kv_blocks=24, max_num_batched_tokens=32, **FP32
    ) as engine:
        assert engine.runner.vocab_shard is not None and engine.async_scheduling
        yield engine
    assert not multiprocessing.active_children() and not dist.is_initialized()


def _marks(engine) -> tuple[int, int]:
    backend = engine.tokenizer.backend
    return backend.token_to_id("<think>"), backend.token_to_id("</think>")


def _workload(rng: random.Random, engine, count: int) -> tuple[list[list[int]], list[SamplingParams]]:
    vocab, (think, _) = engine.vocab_size, _marks(engine)
    prompts, params = [], []
    for _ in range(count):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 50))]
        kind = rng.choice(["greedy", "stop", "sharded", "top_p", "penalty", "think"])
        seed = rng.randrange(1 << 30)
        if kind == "sharded":  # sampled from the vocabulary shards
            extra = {"top_k": rng.choice([0, 20]), "min_p": rng.choice([0.0, 0.05]), "logit_bias": {7: 2.0}}
            params.append(SamplingParams(max_tokens=rng.randrange(4, 20), temperature=0.9, seed=seed, **extra))
        elif kind == "top_p":  # rank 0 samples gathered rows: its step is read before the next one
            params.append(SamplingParams(max_tokens=rng.randrange(4, 16), temperature=0.9, top_p=0.9, seed=seed))
        elif kind == "penalty":  # gathered too, and its history reads the token in flight on rank 0
            params.append(SamplingParams(max_tokens=rng.randrange(4, 16), presence_penalty=1.5, logprobs=2))
        elif kind == "stop":
            stops = rng.sample(range(vocab), vocab // 8)
            params.append(SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=stops))
        elif kind == "think":  # an open <think> block capped at a few tokens: forced </think> rows
            prompt.append(think)
            params.append(SamplingParams(max_tokens=12, ignore_eos=True, max_thinking_tokens=rng.randrange(0, 4)))
        else:
            params.append(SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True))
        prompts.append(prompt)
    return prompts, params


def _run(
    engine,
    prompts,
    params,
    async_scheduling: bool,
    abort_at: dict[int, int] | None = None,
    preempted: list[int] | None = None,
) -> list[tuple]:
    """Drive the engine as a server does; outputs in prompt order (`preempted` gets each one's
    preemption count)."""
    engine.async_scheduling = async_scheduling
    try:
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        streamed: dict[str, list[int]] = {i: [] for i in ids}
        outputs, steps = {}, 0
        while engine.has_unfinished():
            steps += 1
            for index, when in (abort_at or {}).items():
                if when == steps and ids[index] not in outputs:
                    outputs[ids[index]] = engine.abort(ids[index])
            for delta in engine.step():
                streamed[delta.request_id] += delta.token_ids
                if delta.finished:
                    outputs[delta.request_id] = delta.output
    finally:
        engine.async_scheduling = True
    assert engine.scheduler.block_manager.num_used_blocks == 0
    for i in ids:
        assert list(outputs[i].token_ids) == streamed[i], "the deltas do not add up to the output"
    if preempted is not None:
        preempted += [outputs[i].num_preemptions for i in ids]
    return [(outputs[i].token_ids, outputs[i].finish_reason, outputs[i].stop_reason) for i in ids]


def test_async_tp2_gives_the_synchronous_outputs(tp2, rng):
    prompts, params = _workload(rng, tp2, 14)
    kinds = {("top_p" if p.top_p < 1 else "think" if p.max_thinking_tokens is not None else "other") for p in params}
    while kinds != {"top_p", "think", "other"}:  # every kind of step in one workload
        prompts, params = _workload(rng, tp2, 14)
        kinds = {
            ("top_p" if p.top_p < 1 else "think" if p.max_thinking_tokens is not None else "other") for p in params
        }
    expected = _run(tp2, prompts, params, async_scheduling=False)
    assert _run(tp2, prompts, params, async_scheduling=True) == expected
    close = _marks(tp2)[1]
    capped = [i for i, p in enumerate(params) if p.max_thinking_tokens is not None]
    assert all(close in expected[i][0][: params[i].max_thinking_tokens + 1] for i in capped)  # the cap did force


def test_async_tp2_under_preemption_and_aborts(tp2, rng):
    prompts = [[rng.randrange(tp2.vocab_size) for _ in range(n)] for n in (70, 47, 61, 33, 75, 52)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True)] * len(prompts)
    preempted: list[int] = []
    expected = _run(tp2, prompts, params, async_scheduling=False)
    assert _run(tp2, prompts, params, async_scheduling=True, preempted=preempted) == expected
    assert sum(preempted) > 0, "the pool never ran out: nothing was preempted"
    aborts = {i: rng.randrange(2, 12) for i in rng.sample(range(len(prompts)), 2)}
    got = _run(tp2, prompts, params, async_scheduling=True, abort_at=aborts)
    for i, (tokens, reason, _) in enumerate(got):
        if i in aborts:
            assert reason in ("abort", "length") and tokens == expected[i][0][: len(tokens)]
        else:
            assert (tokens, reason) == expected[i][:2]


def test_rank0_launches_each_step_before_it_reads_the_one_before(tp2, rng, monkeypatch):
    events = []
    step, tolist = tp2.workers.step, SampledTokens.tolist

    def logged_step(runner, chunks, all_logits, sampling=None, generators=None, sampled=None, settle=True, shared=None):
        events.append(("launch", sampled is not None))
        return step(runner, chunks, all_logits, sampling, generators, sampled, settle, shared)

    def logged_tolist(self):
        events.append(("read", None))
        return tolist(self)

    monkeypatch.setattr(tp2.workers, "step", logged_step)
    monkeypatch.setattr(sampled_tokens.SampledTokens, "tolist", logged_tolist)
    prompt = [rng.randrange(tp2.vocab_size) for _ in range(9)]
    tp2.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))
    # sharded greedy: each decode launched before the step before it is read, reading its tokens on every rank
    assert events == [("launch", False)] + [("launch", True), ("read", None)] * 4 + [("read", None)]
    events.clear()
    tp2.generate([prompt], SamplingParams(max_tokens=4, temperature=1.0, top_p=0.8, seed=rng.randrange(1 << 30)))
    # top_p: rank 0 samples the gathered rows alone and sends the workers its tokens: launched ahead too
    assert events == [("launch", False)] + [("launch", True), ("read", None)] * 3 + [("read", None)]


class _Pipe:
    """A worker's end of the pipe: the messages rank 0 sent, then end of file."""

    def __init__(self, messages: list[tuple]) -> None:
        self.messages = [pickle.dumps(m) for m in messages]

    def recv_bytes(self) -> bytes:
        if not self.messages:
            raise EOFError
        return self.messages.pop(0)


class _Runner:
    """Logits [rows, 4] from each chunk's last id, one shard of two (columns 0..3 of 8)."""

    vocab_shard = None
    seen: list[list[int]]

    def __init__(self) -> None:
        self.seen = []

    def execute(self, chunks, all_logits, sampled=None):
        ids = [c.token_ids[-1] for c in chunks]
        if sampled is not None:
            ids = [int(sampled[-1 - i]) if i < 0 else i for i in ids]
        self.seen.append(ids)
        return torch.tensor(ids, dtype=torch.float32)


def test_a_worker_resolves_pending_ids_from_its_last_sampled_step(monkeypatch, rng):
    """The worker loop alone: the tokens of a sampled step feed the next step's pending ids; forced
    rows are put in with the step before's tokens; a gathered step leaves none to name."""
    first = [rng.randrange(100, 200) for _ in range(3)]
    greedy = ShardedSampling(None, (None, None, None), (), (), (), ())
    capped = ShardedSampling(None, (None, Rule(1.0, 0, 0.0), None), (), (), (), (), Forced(5, always=(2,)))

    def finish(shard, logits, sampling, generators=None, in_flight=None):  # "samples": id + 1
        if sampling is None:
            return logits
        ids = logits.long() + 1
        if sampling.forced is not None:
            ids[list(sampling.forced.always)] = sampling.forced.token
        return ids, logits

    shared = [rng.randrange(300, 400) for _ in range(2)]

    def share(shard, ids, count, device):  # what rank 0 sends
        assert ids is None and count == len(shared)
        return torch.tensor(shared)

    monkeypatch.setattr(worker_process, "finish_step", finish)
    monkeypatch.setattr(worker_process, "share_tokens", share)
    chunk = lambda token: StepChunk((token,), 0, (0,))  # noqa: E731
    runner = _Runner()
    worker_process._serve(
        _Pipe(
            [
                ("step", tuple(map(chunk, first)), False, greedy, None, 0),
                ("step", (chunk(pending(2)), chunk(pending(0)), chunk(pending(1))), False, capped, None, 0),
                ("step", (chunk(9), chunk(10), chunk(11)), True, None, None, 0),  # a scoring pass keeps the tokens
                ("step", (chunk(pending(2)), chunk(3), chunk(pending(0))), False, None, 2, 0),  # rank 0 sends 2 ids
                ("step", (chunk(pending(1)), chunk(pending(0))), False, None, None, 0),
            ]
        ),
        runner,
    )
    sampled = [t + 1 for t in first]
    assert runner.seen[1] == [sampled[2], sampled[0], sampled[1]]
    second = [sampled[2] + 1, sampled[0] + 1, 5]  # row 2 forced to 5
    assert runner.seen[3] == [second[2], 3, second[0]]
    assert runner.seen[4] == [shared[1], shared[0]]
    with pytest.raises(ValueError, match="pending token ids, but this rank's step before sampled none"):
        worker_process._serve(
            _Pipe(
                [("step", (chunk(4),), False, None, None, 0), ("step", (chunk(pending(0)),), False, greedy, None, 0)]
            ),
            _Runner(),
        )
