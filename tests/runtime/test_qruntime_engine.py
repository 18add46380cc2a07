"""The engine on compiled tiny artifacts: batching, chunked prefill and preemption do not change
tokens; every KV layout gives the same outputs; fused and unfused graphs agree; sampling, stopping,
streaming, chat, timings, and bad requests that leave the engine serving."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import qruntime
import torch
from hf_reference import sqnr_db
from qruntime import InvalidRequest, SamplingParams
from qruntime.artifact import sha256_file

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
BF16_EPS = 2.0**-7  # bf16's relative spacing: 8 significant bits


def _prompts(rng: random.Random, count: int, vocab: int, longest: int = 70) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, longest))] for _ in range(count)]


@pytest.fixture(scope="module")
def fp8_artifact(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "ptpc-fp8")


def _alone(engine, prompts, params=GREEDY):
    return [engine.generate([p], params)[0].token_ids for p in prompts]


def test_batch_equals_each_prompt_alone(fp8_artifact, rng):
    engine = qruntime.load(fp8_artifact, device="cpu", num_kv_blocks=256)
    prompts = _prompts(rng, 10, engine.vocab_size)
    outputs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == _alone(engine, prompts)
    assert all(len(o.token_ids) == 20 and o.finish_reason == "length" for o in outputs)
    assert engine.scheduler.block_manager.num_used_blocks == 0


def _same_but_at_a_tie(engine, prompt, got, expected) -> None:
    """`got` equals `expected` (greedy tokens), or first differs where the two best logits of the
    expected path are within bf16 rounding of each other: chunks and batches of other sizes round
    the bf16 logits otherwise (seen: 0.4023 vs 0.3984, one bf16 step apart), and past that token
    the two texts go their own ways. A real fault moves logits by far more."""
    k = next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None)
    if k is None:
        return
    logits = engine.score(list(prompt) + list(expected[:k]))[-1].float()
    best = logits.max().item()
    near = set((logits >= best - 3 * BF16_EPS * max(abs(best), 1e-3)).nonzero().flatten().tolist())
    assert {got[k], expected[k]} <= near, (k, got[k], expected[k], logits.topk(3))


def test_preemption_and_chunked_prefill_keep_the_tokens(fp8_artifact, rng):
    roomy = qruntime.load(fp8_artifact, device="cpu", num_kv_blocks=256)
    # fixed lengths (random tokens): with ignore_eos the schedule depends on lengths only, and this one
    # chunks every prompt (24-token budget) and runs out of blocks (12 blocks of 16 hold about two)
    prompts = [[rng.randrange(roomy.vocab_size) for _ in range(n)] for n in (70, 47, 61, 33, 75, 52, 29, 66)]
    expected = _alone(roomy, prompts)
    tight = qruntime.load(fp8_artifact, device="cpu", num_kv_blocks=12, max_model_len=96, max_num_batched_tokens=24)
    outputs = tight.generate(prompts, GREEDY)
    for prompt, output, alone in zip(prompts, outputs, expected, strict=True):
        _same_but_at_a_tie(roomy, prompt, output.token_ids, alone)
    assert sum(o.num_preemptions for o in outputs) > 0
    assert tight.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_every_kv_layout_gives_identical_outputs(tiny_odd_ckpt, compiled, kv_dtype, rng):
    prompts = _prompts(rng, 4, 538)
    results = {}
    for layout in ("nhd", "hnd", "x-packed"):
        artifact = compiled(tiny_odd_ckpt, "ptpc-fp8", f"kv_cache.layout={layout}", f"kv_cache.dtype={kv_dtype}")
        engine = qruntime.load(artifact, device="cpu", num_kv_blocks=64)
        results[layout] = ([o.token_ids for o in engine.generate(prompts, GREEDY)], engine.score(prompts[0]))
    tokens, logits = results.pop("nhd")
    for layout, (other_tokens, other_logits) in results.items():
        assert other_tokens == tokens, layout
        assert torch.equal(other_logits, logits), layout


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_moe_ckpt"])
def test_fused_and_unfused_graphs_agree(request, fixture, compiled, rng):
    ckpt = request.getfixturevalue(fixture)
    fused = qruntime.load(compiled(ckpt, "ptpc-fp8"), device="cpu", dtype=torch.float32, num_kv_blocks=64)
    unfused = qruntime.load(compiled(ckpt, "ptpc-fp8-unfused"), device="cpu", dtype=torch.float32, num_kv_blocks=64)
    assert len(unfused.runner.plan.nodes) > len(fused.runner.plan.nodes)
    ids = _prompts(rng, 1, fused.vocab_size)[0]
    # same weights, same per-token activation quantization: equal up to fp32 summation order
    assert sqnr_db(unfused.score(ids), fused.score(ids)) > 60


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_moe_ckpt"])
def test_tensor_fp8_generates_and_scores_close_to_bf16(request, fixture, compiled, rng):
    """Per-tensor weights and activations: logits within FP8 rounding of the bf16 artifact's (one e4m3
    rounding is ~32 dB; these models give 24-27 dB through the layers, ptpc-fp8 about 1 dB more),
    and a batch generates to its length. Fused and unfused agree where the math is the same (dense)."""
    ckpt = request.getfixturevalue(fixture)
    fp8 = qruntime.load(compiled(ckpt, "tensor-fp8"), device="cpu", dtype=torch.float32, num_kv_blocks=64)
    bf16 = qruntime.load(compiled(ckpt, "bf16"), device="cpu", dtype=torch.float32, num_kv_blocks=64)
    ids = _prompts(rng, 1, fp8.vocab_size, longest=80)[0] + [rng.randrange(fp8.vocab_size) for _ in range(16)]
    logits, reference = fp8.score(ids), bf16.score(ids)
    assert sqnr_db(reference, logits) > 18 and not torch.allclose(logits, reference, atol=1e-4)
    assert float((logits.argmax(-1) == reference.argmax(-1)).float().mean()) >= 0.6
    outputs = fp8.generate(_prompts(rng, 4, fp8.vocab_size), GREEDY)
    assert all(len(o.token_ids) == 20 and o.finish_reason == "length" for o in outputs)
    assert any(o.text for o in outputs)  # detokenized text
    if fixture == "tiny_ckpt":
        unfused = compiled(ckpt, "tensor-fp8", "passes=[]")
        unfused = qruntime.load(unfused, device="cpu", dtype=torch.float32, num_kv_blocks=64)
        assert sqnr_db(unfused.score(ids), logits) > 60


def test_seeded_sampling_is_reproducible_and_batch_independent(fp8_artifact, rng):
    # fp32: bf16 logits of a batch and of a lone prompt may differ in the last bit, which greedy
    # shrugs off but a sample landing right on a probability boundary does not
    engine = qruntime.load(fp8_artifact, device="cpu", dtype=torch.float32, num_kv_blocks=256)
    prompts = _prompts(rng, 4, engine.vocab_size)
    sampled = SamplingParams(max_tokens=16, temperature=1.3, top_k=50, top_p=0.95, seed=1234, ignore_eos=True)
    batch = [o.token_ids for o in engine.generate(prompts, sampled)]
    assert batch == _alone(engine, prompts, sampled)
    other_seed = SamplingParams(max_tokens=16, temperature=1.3, top_k=50, top_p=0.95, seed=99, ignore_eos=True)
    assert batch != [o.token_ids for o in engine.generate(prompts, other_seed)]
    greedy = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    assert batch != greedy
    # top_k=1 and a tiny top_p leave only the argmax, whatever the temperature
    for narrow in (dict(top_k=1), dict(top_p=1e-6)):
        params = SamplingParams(max_tokens=16, temperature=5.0, ignore_eos=True, **narrow)
        assert [o.token_ids for o in engine.generate(prompts, params)] == greedy


def test_stop_strings_stop_tokens_and_eos(fp8_artifact, rng, tmp_path):
    engine_dir = fp8_artifact
    engine = qruntime.load(engine_dir, device="cpu", num_kv_blocks=64)
    prompt = "the quick brown fox"
    full = engine.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    cut = rng.randrange(3, 12)
    # stop token id: the output ends with that token (the first time it appears)
    token = full.token_ids[cut]
    out = engine.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(token,)))[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(token) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", token)
    # stop string: text ends right before it
    text = full.text
    start = rng.randrange(2, max(3, len(text) - 3))
    stop = text[start : start + 2]
    out = engine.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,)))[0]
    assert out.text == text[: text.index(stop)] and stop not in out.text
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    # an EOS id of generation_config.json stops unless ignore_eos
    eos = full.token_ids[cut]
    eos_engine = qruntime.load(_with_eos(engine_dir, tmp_path / "eos", eos), device="cpu", num_kv_blocks=64)
    out = eos_engine.generate(prompt, SamplingParams(max_tokens=24))[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(eos) + 1] and out.finish_reason == "stop"
    assert eos_engine.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids == full.token_ids


def _with_eos(artifact: Path, out: Path, eos: int) -> Path:
    """A copy of the artifact whose generation_config.json also lists `eos` as an EOS id."""
    shutil.copytree(artifact, out)
    path = out / "generation_config.json"
    config = json.loads(path.read_text())
    config["eos_token_id"] = [*config["eos_token_id"], eos]
    path.write_text(json.dumps(config))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["generation_config.json"] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_stream_yields_what_generate_returns_and_closing_aborts(fp8_artifact, rng):
    engine = qruntime.load(fp8_artifact, device="cpu", num_kv_blocks=64)
    prompt = _prompts(rng, 1, engine.vocab_size)[0]
    expected = engine.generate([prompt], GREEDY)[0]
    deltas = list(engine.stream(prompt, GREEDY))
    assert sum((d.token_ids for d in deltas), ()) == expected.token_ids
    assert "".join(d.text for d in deltas) == expected.text
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].output.token_ids == expected.token_ids
    stream = engine.stream(prompt, GREEDY)
    next(stream)
    assert engine.scheduler.block_manager.num_used_blocks > 0
    stream.close()
    assert engine.scheduler.block_manager.num_used_blocks == 0 and not engine.has_unfinished()


def test_chat_uses_the_checkpoint_template(fp8_artifact):
    engine = qruntime.load(fp8_artifact, device="cpu", num_kv_blocks=64)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    out = engine.chat(messages, GREEDY)[0]
    assert out.prompt_token_ids == tuple(engine.tokenizer.encode_chat(messages))
    assert out.token_ids == engine.generate([engine.tokenizer.encode_chat(messages)], GREEDY)[0].token_ids
    assert "<|im_start|>assistant" in engine.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)


def test_timings(fp8_artifact):
    out = qruntime.load(fp8_artifact, device="cpu", num_kv_blocks=64).generate("hello", GREEDY)[0]
    t = out.timings
    assert 0 < t.ttft <= t.e2e and t.tpot > 0 and t.num_output_tokens == 20
    assert t.ttft + 19 * t.tpot == pytest.approx(t.e2e)


def test_bad_requests_are_refused_and_the_engine_keeps_serving(fp8_artifact, rng):
    engine = qruntime.load(fp8_artifact, device="cpu", num_kv_blocks=64, max_model_len=64)
    prompt = _prompts(rng, 1, engine.vocab_size, longest=40)[0]
    expected = engine.generate([prompt], GREEDY)[0].token_ids
    running = engine.add_request(prompt, GREEDY)
    engine.step()
    bad = {
        "": "empty prompt",
        (): "empty prompt",
        tuple(range(64)): "prompt is 64 tokens but the context is 64 tokens",
        (1, 2, engine.vocab_size): f"unknown token id {engine.vocab_size} at position 2",
        (1, -1): "unknown token id -1 at position 1",
        (1, 2.5): "token ids must be integers",
        (1, True, 3): r"token ids must be integers \(position 1: True\)",
        None: "a prompt is a string or a list of token ids",
    }
    for prompt_value, message in bad.items():
        with pytest.raises(InvalidRequest, match=message):
            engine.add_request(
                prompt_value if prompt_value is None or isinstance(prompt_value, str) else list(prompt_value), GREEDY
            )
    with pytest.raises(InvalidRequest, match="prompt 1: empty prompt"):
        engine.generate(["fine", ""], GREEDY)
    with pytest.raises(ValueError, match="max_tokens must be ≥ 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequest, match="must be a SamplingParams"):
        engine.add_request("hi", {"max_tokens": 3})
    outputs = {}
    while engine.has_unfinished():
        outputs.update((d.request_id, d.output) for d in engine.step() if d.finished)
    assert outputs[running].token_ids == expected
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_generation_stops_at_the_context_length(fp8_artifact):
    engine = qruntime.load(fp8_artifact, device="cpu", num_kv_blocks=8, max_model_len=40)
    out = engine.generate([list(range(1, 31))], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_close_drops_the_decode_graphs_after_a_sync_and_before_the_workers_stop(fp8_artifact, monkeypatch):
    """At tp > 1 the captured graphs hold NCCL kernels of the group the workers' close aborts, so the
    graphs go first, once the device has finished them."""
    engine = qruntime.load(fp8_artifact, device="cpu", num_kv_blocks=32)
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", device)))

    class FakeWorkers:
        def close(self):
            events.append(("workers.close", engine.runner.decode_graphs))

    engine.runner.decode_graphs = object()  # what a CUDA engine holds; CPU engines capture none
    engine.workers = FakeWorkers()
    engine.close()
    assert events == [("sync", engine.runner.device), ("workers.close", None)]
    engine.close()  # idempotent: nothing left to sync
    assert events[2:] == [("workers.close", None)]
    with pytest.raises(RuntimeError, match="the engine is closed"):
        engine.generate([[1, 2, 3]], GREEDY)


def test_min_tokens_holds_back_stop_tokens_and_eos(fp8_artifact, rng, tmp_path):
    """Before min_tokens outputs, a stop token id and an EOS id are not sampled (greedy takes the next
    best), with async scheduling's pending tokens counted; from there they stop the generation again."""
    engine = qruntime.load(fp8_artifact, device="cpu", num_kv_blocks=64)
    prompt = [rng.randrange(500) for _ in range(rng.randrange(3, 20))]
    first = engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0].token_ids[0]
    stopped = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(first,)))[0]
    assert stopped.token_ids == (first,) and stopped.finish_reason == "stop"
    least = rng.randrange(2, 10)
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(first,), min_tokens=least)
    out = engine.generate([prompt], params)[0]
    assert len(out.token_ids) >= least and first not in out.token_ids[:least]
    assert out.token_ids[0] != first and (out.finish_reason == "length" or out.token_ids[-1] == first)
    # pushed up at every step, the stop token comes exactly once the ban lifts: as output `least`
    pushed = SamplingParams(
        max_tokens=24, ignore_eos=True, stop_token_ids=(first,), min_tokens=least, logit_bias={first: 100.0}
    )
    out = engine.generate([prompt], pushed)[0]
    assert len(out.token_ids) == least + 1 and out.token_ids[-1] == first and first not in out.token_ids[:-1]
    # the same with the token as an EOS id of the model (ignore_eos off)
    eos_engine = qruntime.load(_with_eos(fp8_artifact, tmp_path / "eos", first), device="cpu", num_kv_blocks=64)
    out = eos_engine.generate([prompt], SamplingParams(max_tokens=24, min_tokens=least))[0]
    assert len(out.token_ids) >= least and first not in out.token_ids[:least]


def test_min_tokens_holds_back_stop_strings(fp8_artifact, rng):
    """A stop string is looked for only in the text of the tokens after the first min_tokens: the first
    token's own text, a stop string at once without it, is passed over with min_tokens (greedy: the
    same tokens either way, up to where the stop string next completes)."""
    engine = qruntime.load(fp8_artifact, device="cpu", num_kv_blocks=64)
    # random weights: a prompt whose first one or two tokens are not whitespace only, nor part of a
    # character (decoded alone to U+FFFD, which the text never shows: the detokenizer holds such bytes
    # back until the character completes, so no stop string of it matches where the test expects; CI
    # at 2e4bb22 drew one)
    for _ in range(20):
        prompt = [rng.randrange(500) for _ in range(rng.randrange(3, 20))]
        plain = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
        stop = engine.tokenizer.decode(plain.token_ids[:1]).strip()
        if not stop:  # a token of whitespace only: the first two tokens' text
            stop = engine.tokenizer.decode(plain.token_ids[:2]).strip()
        if stop and "\ufffd" not in stop:
            break
    assert stop and "\ufffd" not in stop and plain.text.lstrip().startswith(stop)
    at_once = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, stop=(stop,)))[0]
    assert at_once.finish_reason == "stop" and stop not in at_once.text and len(at_once.token_ids) <= 2
    least = rng.randrange(3, 8)
    held = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, stop=(stop,), min_tokens=least))[0]
    assert len(held.token_ids) > least and held.token_ids == plain.token_ids[: len(held.token_ids)]
    assert held.text.startswith(engine.tokenizer.decode(plain.token_ids[:least]))


def test_logit_bias_steers_generation_and_names_unknown_tokens(fp8_artifact, rng):
    engine = qruntime.load(fp8_artifact, device="cpu", num_kv_blocks=64)
    prompt = [rng.randrange(500) for _ in range(rng.randrange(3, 20))]
    forced = rng.randrange(engine.vocab_size)
    out = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={forced: 100.0}))[0]
    assert out.token_ids == (forced,) * 6
    free = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    out = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={free[0]: -100.0}))[0]
    assert out.token_ids[0] != free[0]
    with pytest.raises(qruntime.InvalidRequest, match=f"logit_bias: {engine.vocab_size} is not a token id"):
        engine.add_request(prompt, SamplingParams(logit_bias={engine.vocab_size: 1.0}))


def test_penalties_count_the_output_in_flight(fp8_artifact, rng):
    """With async scheduling a request's newest output is still on the device when the next step
    samples: the penalties read it there, so the outputs equal those of an engine that waits."""
    engines = [qruntime.load(fp8_artifact, device="cpu", num_kv_blocks=64) for _ in range(2)]
    engines[1].async_scheduling = False
    # a workload whose greedy outputs the penalties change (with some prompts the random model never
    # repeats a token, and then they change nothing: seed 859051095): up to 8 are drawn
    for _ in range(8):
        prompts = [[rng.randrange(500) for _ in range(rng.randrange(3, 20))] for _ in range(4)]
        params = SamplingParams(
            max_tokens=12, ignore_eos=True, repetition_penalty=rng.uniform(5, 50),
            presence_penalty=rng.uniform(0.5, 2), frequency_penalty=rng.uniform(0.5, 2),
        )  # fmt: skip
        waited, overlapped = (e.generate(prompts, params) for e in engines)
        assert [o.token_ids for o in overlapped] == [o.token_ids for o in waited]
        free = engines[0].generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        if [o.token_ids for o in free] != [o.token_ids for o in waited]:
            break
    else:
        raise AssertionError("the penalties changed no greedy choice in 8 workloads")
