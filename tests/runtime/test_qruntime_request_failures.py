"""Failures that belong to requests fail those requests alone: non-finite logits or a detokenizer
error fail one request, a model step that raises fails its batch, and the engine serves on, its KV
blocks all back; a device error (torch.AcceleratorError) is raised, since no step can run after it.
Prompts that are not text are InvalidRequest."""

from __future__ import annotations

import logging
import random

import pytest
import qruntime
import qruntime.engine.engine
import torch
from qruntime import InvalidRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def artifact(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "ptpc-fp8")


def _prompts(rng: random.Random, count: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randrange(2, 30))] for _ in range(count)]


def _engine(artifact):
    return qruntime.load(artifact, device="cpu", num_kv_blocks=128, max_model_len=128)


def _poison(monkeypatch, victim: SamplingParams, value: float) -> None:
    """The logits the engine samples from hold `value` in the row of the request sampled with `victim`
    (that very object)."""
    sample = qruntime.engine.engine.sample_on_device

    def poisoned(logits, params, generators, *rest):
        logits = logits.clone()
        for row, p in enumerate(params):
            if p is victim:
                logits[row, row % logits.shape[1]] = value
        return sample(logits, params, generators, *rest)

    monkeypatch.setattr(qruntime.engine.engine, "sample_on_device", poisoned)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_logits_fail_that_request_alone(artifact, rng, value, caplog, monkeypatch):
    engine = _engine(artifact)
    prompts = _prompts(rng, 4, engine.vocab_size)
    expected = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    victim = rng.randrange(4)
    poisoned = SamplingParams(max_tokens=12, ignore_eos=True)
    _poison(monkeypatch, poisoned, value)
    ids = [engine.add_request(p, poisoned if i == victim else GREEDY) for i, p in enumerate(prompts)]
    outputs = {}
    while engine.has_unfinished():
        outputs.update((d.request_id, d.output) for d in engine.step() if d.finished)
    for i, request_id in enumerate(ids):
        out = outputs[request_id]
        if i == victim:
            assert out.finish_reason == "error" and "non-finite logits" in out.error
        else:
            assert out.finish_reason == "length" and out.error is None and list(out.token_ids) == list(expected[i])
    assert engine.scheduler.block_manager.num_used_blocks == 0
    assert any(ids[victim] in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


def test_a_failing_step_fails_its_batch_and_the_engine_serves_on(artifact, rng, caplog):
    engine = _engine(artifact)
    execute = engine.runner.execute
    calls = {"n": 0}

    def fail_third_step(chunks, all_logits=False, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("a Triton kernel failed to compile for this shape")
        return execute(chunks, all_logits, **kw)

    engine.runner.execute = fail_third_step
    prompts = _prompts(rng, 3, engine.vocab_size)
    outputs = engine.generate(prompts, GREEDY)
    assert [o.finish_reason for o in outputs] == ["error"] * 3
    assert all(o.error == "the model step running this request failed" for o in outputs)
    assert all("Triton" not in o.error for o in outputs)  # the cause is in the log, not the output
    assert any("Triton" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)
    assert engine.scheduler.block_manager.num_used_blocks == 0
    again = engine.generate(prompts, GREEDY)  # the engine still serves
    assert [o.finish_reason for o in again] == ["length"] * 3


def test_a_detokenizer_error_fails_that_request_alone(artifact, rng):
    engine = _engine(artifact)
    prompts = _prompts(rng, 3, engine.vocab_size)
    ids = [engine.add_request(p, GREEDY) for p in prompts]

    def broken_add(token_id):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    engine._tracked[ids[1]].detok.add = broken_add
    outputs = {}
    while engine.has_unfinished():
        outputs.update((d.request_id, d.output) for d in engine.step() if d.finished)
    assert outputs[ids[1]].finish_reason == "error" and "into text" in outputs[ids[1]].error
    assert [outputs[ids[i]].finish_reason for i in (0, 2)] == ["length", "length"]
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_a_device_error_is_raised(artifact, rng):
    engine = _engine(artifact)

    def device_lost(chunks, all_logits=False, **kw):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    engine.runner.execute = device_lost
    engine.add_request(_prompts(rng, 1, engine.vocab_size)[0], GREEDY)
    with pytest.raises(torch.AcceleratorError, match="illegal memory access"):
        engine.step()


@pytest.mark.parametrize("prompt", ["ab\ud800cd", "\udfff", "ok \ud83d"])
def test_a_prompt_that_is_not_text_is_an_invalid_request(artifact, prompt):
    engine = _engine(artifact)
    with pytest.raises(InvalidRequest, match="lone surrogate"):
        engine.generate(prompt, GREEDY)
    assert not engine.has_unfinished()
