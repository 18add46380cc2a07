"""An engine step is queued on the GPU without the host waiting for the device: every kind of step
(decode graphs, piecewise prefill and mixed steps, chunks after a cached prefix, chunks that do not
sample) and every sampling option, logprobs, the thinking cap and structured output included. A blocking
host-to-device copy (torch.tensor(..., device=cuda), t.to(cuda), indexing with a list) waits for the step in flight, which undoes async scheduling: mixed
steps used to make nine such copies each."""

from __future__ import annotations

import json
import warnings

import pytest
import qruntime
import torch
from qruntime.engine.structured import StructuredOutput

pytestmark = pytest.mark.gpu


def _syncs_of(call):
    """(call(), the synchronizing CUDA calls it made): torch's sync debug mode warns for each, naming
    the Python line that made it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, [f"{w.filename}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message)]


def _guard_launches(engine) -> list[tuple[str, list[str]]]:
    """Record, for each step the engine launches, its kind and the synchronizing calls made launching it."""
    launches: list[tuple[str, list[str]]] = []
    launch, execute = engine._launch, engine.runner.execute
    kinds: list[str] = []

    def recorded_execute(chunks, all_logits=False, sampled=None):
        decodes = sum(c.num_tokens == 1 for c in chunks)
        kinds.append("decode" if decodes == len(chunks) else f"{len(chunks) - decodes} prefill + {decodes} decode")
        return execute(chunks, all_logits=all_logits, sampled=sampled)

    def guarded(previous, *args):
        kinds.clear()
        result, syncs = _syncs_of(lambda: launch(previous, *args))
        if kinds:
            launches.append((kinds[0], syncs))
        return result

    engine._launch = guarded
    engine.runner.execute = recorded_execute
    return launches


def test_the_guard_sees_a_blocking_copy(cuda):
    _, syncs = _syncs_of(lambda: torch.tensor([1, 2, 3], device=cuda))
    assert syncs, "torch's sync debug mode reported no sync for a blocking host-to-device copy"
    _, syncs = _syncs_of(lambda: torch.tensor([1, 2, 3]).pin_memory().to(cuda, non_blocking=True))
    assert not syncs, syncs


def test_steps_are_launched_without_a_host_sync(gpu_artifact, cuda, rng):
    engine = qruntime.load(
        gpu_artifact,
        device=cuda,
        max_model_len=1024,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        kv_cache_memory=256 << 20,
        graph_capture="load",  # a capture at first use waits for the device: the steps' own syncs are counted
    )
    assert engine.runner.decode_graphs is not None and engine.runner.piecewise_graphs is not None
    vocab = 500

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    shared = prompt(96)  # six full KV blocks, cached once its first request has run
    engine.generate(shared + prompt(7), qruntime.SamplingParams(max_tokens=2))
    launches = _guard_launches(engine)
    sampled = [
        qruntime.SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=20, ignore_eos=True),
        qruntime.SamplingParams(
            max_tokens=24, temperature=1.1, min_p=0.05, seed=rng.randrange(1 << 30), ignore_eos=True
        ),
        qruntime.SamplingParams(max_tokens=24, temperature=0.7, seed=rng.randrange(1 << 30), ignore_eos=True),
        qruntime.SamplingParams(
            max_tokens=24, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, ignore_eos=True
        ),
        qruntime.SamplingParams(max_tokens=24, logit_bias={11: 5.0, 12: -100.0}, min_tokens=8, ignore_eos=False),
        qruntime.SamplingParams(max_tokens=24, logprobs=3, prompt_logprobs=2, ignore_eos=True),
        qruntime.SamplingParams(  # its masks are made after the forward is queued, from the token in flight
            max_tokens=24,
            structured=StructuredOutput("json_schema", json.dumps({"type": "array", "items": {"type": "integer"}})),
        ),
    ]
    ids = [engine.add_request(prompt(rng.randrange(5, 40)), p) for p in sampled]
    think = engine.tokenizer.backend.token_to_id("<think>")  # a block the cap closes, on the device or not
    capped = qruntime.SamplingParams(max_tokens=12, max_thinking_tokens=rng.randrange(0, 4), ignore_eos=True)
    ids.append(engine.add_request(prompt(9) + [think], capped))
    finished = {}

    def collect(deltas) -> None:
        finished.update((d.request_id, d.output) for d in deltas if d.finished)

    for _ in range(4):  # decode steps, then prompts arrive beside them: mixed steps
        collect(engine.step())  # a structured row may finish here: its grammar can close in a few tokens
    ids += [
        engine.add_request(shared + prompt(rng.randrange(3, 30)), qruntime.SamplingParams(max_tokens=16))
        for _ in range(2)
    ]
    ids.append(
        engine.add_request(prompt(700), qruntime.SamplingParams(max_tokens=8))
    )  # chunked: its first chunk samples nothing
    while engine.has_unfinished():
        collect(engine.step())
    assert set(finished) == set(ids)
    assert all(o.finish_reason in ("length", "stop") for o in finished.values()), [
        o.finish_reason for o in finished.values()
    ]
    kinds = {kind for kind, _ in launches}
    assert "decode" in kinds and any("prefill" in k and not k.endswith("+ 0 decode") for k in kinds), kinds
    assert engine.prefix_cache_stats.hits >= 2 * 96, engine.prefix_cache_stats
    synced = [(kind, syncs) for kind, syncs in launches if syncs]
    assert not synced, f"{len(synced)} of {len(launches)} launches waited for the device: {synced[:3]}"
    engine.close()
