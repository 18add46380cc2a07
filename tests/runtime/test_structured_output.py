"""Structured output (SamplingParams.structured, llguidance): over many fresh random JSON schemas, and
regexes, choices and a Lark grammar, every output a sampled random-weight model makes under the
constraint parses and matches it; a constraint that does not compile is refused when the request is
added; constrained and free requests share batches."""

from __future__ import annotations

import json
import re

import pytest
import qruntime
from qruntime.engine.outputs import InvalidRequest
from qruntime.engine.sampling_params import SamplingParams
from qruntime.engine.structured import StructuredOutput, StructuredOutputError

WORDS = ("alpha", "beta", "gamma", "delta")


def _schema(rng, depth: int = 0) -> dict:
    """A random schema of the kinds a JSON API takes: objects of typed, enum, array and nested fields."""
    kinds = ["integer", "boolean", "string", "enum", "number"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randrange(1, 4))}
    if kind == "integer":
        low = rng.randrange(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randrange(0, 100)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randrange(1, 8)}
    if kind == "array":
        return {"type": "array", "items": _schema(rng, depth + 1), "maxItems": rng.randrange(0, 4)}
    if kind == "object":
        return _object(rng, depth + 1)
    return {"type": kind}


def _object(rng, depth: int = 0) -> dict:
    names = rng.sample(["id", "name", "tags", "size", "ok", "kind", "meta"], rng.randrange(1, 4))
    return {
        "type": "object",
        "properties": {n: _schema(rng, depth) for n in names},
        "required": names,
        "additionalProperties": False,
    }


def _valid(value, schema: dict) -> bool:
    """A validator of the schemas _schema makes."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "integer":
        return (
            isinstance(value, int) and not isinstance(value, bool) and schema["minimum"] <= value <= schema["maximum"]
        )
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema["maxLength"]
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= schema["maxItems"]
            and all(_valid(v, schema["items"]) for v in value)
        )
    return (
        isinstance(value, dict)
        and set(value) == set(schema["required"])
        and all(_valid(value[k], s) for k, s in schema["properties"].items())
    )


@pytest.fixture(scope="module")
def engine(tiny_ckpt, compiled):
    return qruntime.load(compiled(tiny_ckpt, "bf16"), device="cpu", dtype="float32", max_model_len=512)


def _sampled(rng, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=300, temperature=1.0, seed=rng.randrange(1 << 30), **kwargs)


def test_outputs_match_many_fresh_random_schemas(engine, rng):
    schemas = [_object(rng) for _ in range(12)]
    params = [_sampled(rng, structured=StructuredOutput("json_schema", json.dumps(s))) for s in schemas]
    outputs = engine.generate([[rng.randrange(10, 400) for _ in range(5)] for _ in schemas], params)
    for schema, out in zip(schemas, outputs, strict=True):
        assert out.finish_reason == "stop", (schema, out.text)
        assert _valid(json.loads(out.text), schema), (schema, out.text)


def test_regexes_choices_objects_and_a_grammar(engine, rng):
    cases = [
        (StructuredOutput("regex", r"[a-c]{2,4}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", t)),
        (StructuredOutput("choice", ("yes", "no", "not sure")), lambda t: t in ("yes", "no", "not sure")),
        (StructuredOutput("json_object"), lambda t: isinstance(json.loads(t), dict)),
        (
            StructuredOutput("grammar", 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'),
            lambda t: re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", t),
        ),
    ]
    free = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [[rng.randrange(10, 400) for _ in range(4)] for _ in range(len(cases) + 1)]
    # any JSON object allows strings of any length, which a random-weight model would not end within
    # max_tokens: favouring '"' and '}' (a bias the mask still constrains) ends them early
    closing = {t: 8.0 for t in (*engine.tokenizer.encode('"', False), *engine.tokenizer.encode("}", False))}
    params = [_sampled(rng, structured=c, logit_bias=closing if c.kind == "json_object" else {}) for c, _ in cases]
    outputs = engine.generate(prompts, [*params, free])
    for (constraint, check), out in zip(cases, outputs, strict=False):
        assert out.finish_reason == "stop" and check(out.text), (constraint, out.text)
    assert len(outputs[-1].token_ids) == 6  # the free request beside them ran as usual


def test_a_constraint_that_does_not_compile_is_refused(engine):
    for constraint, words in (
        (StructuredOutput("json_schema", json.dumps({"type": "nothing"})), "type"),
        (StructuredOutput("regex", "[a-z"), "regex"),
        (StructuredOutput("grammar", "start: undefined_rule"), "undefined"),
        (StructuredOutput("json_schema", "{not json"), "not JSON"),
    ):
        with pytest.raises(InvalidRequest, match=words):
            engine.add_request([1, 2, 3], SamplingParams(structured=constraint))
    with pytest.raises(StructuredOutputError, match="choice"):
        StructuredOutput("choice", ())
    with pytest.raises(StructuredOutputError, match="kind"):
        StructuredOutput("xml", "<a/>")


def test_masks_follow_the_token_in_flight_as_a_synchronous_engine_does(tiny_ckpt, compiled, rng, monkeypatch):
    """With async scheduling the next step's forward is queued before the step in flight is read,
    and its masks made and sampling queued after: seeded structured requests beside free ones (some
    ending early, so the batch changes while constrained rows are in flight) give the synchronous
    engine's tokens."""
    from qruntime.engine import engine as engine_module

    schemas = [_object(rng) for _ in range(4)]
    prompts = [[rng.randrange(10, 400) for _ in range(rng.randrange(2, 30))] for _ in range(7)]
    params = [_sampled(rng, structured=StructuredOutput("json_schema", json.dumps(s))) for s in schemas]
    params += [SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True) for _ in range(3)]
    outputs, order = {}, []
    sample = engine_module.sample_on_device

    def recording_sample(logits, params, *args, **kw):
        order.append("masked sample" if args[-1] is not None else "sample")
        return sample(logits, params, *args, **kw)

    monkeypatch.setattr(engine_module, "sample_on_device", recording_sample)
    for async_scheduling in (False, True):
        engine = qruntime.load(compiled(tiny_ckpt, "bf16"), device="cpu", dtype="float32", max_model_len=512)
        engine.async_scheduling = async_scheduling
        execute, complete = engine.runner.execute, engine._complete

        def recording_execute(*args, execute=execute, **kw):
            order.append("forward")
            return execute(*args, **kw)

        def recording_complete(launched, complete=complete):
            order.append("read")
            return complete(launched)

        engine.runner.execute, engine._complete = recording_execute, recording_complete
        order.clear()
        outputs[async_scheduling] = [(o.token_ids, o.text) for o in engine.generate(prompts, params)]
    assert outputs[True] == outputs[False]
    for (_, text), schema in zip(outputs[True], schemas, strict=False):
        assert _valid(json.loads(text), schema), text
    # async: every masked sampling after the first step comes after a forward and the read it overlaps
    masked = [i for i, event in enumerate(order) if event == "masked sample"]
    assert len(masked) > 10 and order[: masked[0] + 1] == ["forward", "masked sample"]
    assert all(order[i - 2 : i] == ["forward", "read"] for i in masked[1:]), order
